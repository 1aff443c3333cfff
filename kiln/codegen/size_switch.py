"""SizeSwitch: a region run by one of two kernels, picked by the sizes it is bound at.

Why: a decode step's batch dim (bounded <= 64, every size captured as a CUDA graph of
its own) is timed at both its ends (autotune/both_ends.py), and one kernel cannot win
at both: on the Llama-3-8B (H100) the config that won at 1 row cost 4 rows 12% of
their replay (8.14 -> 9.14 ms). A prompt-length dim of a matmul or attention region
is timed at 512 rows and its finalists at 2048 and 128 (autotune/timing.top_env,
bottom_env): where short and long prompts want different kernels, the same switch runs
each. A launch is bound once
per set of sizes (Program binds one per size, a CUDA graph captures one binding), so
choosing between two kernels costs nothing per call: `bind` asks the one chosen for
the bound sizes.

`low_sizes`: per dim, the largest size the low end's kernel runs; at a binding where
every one of these dims is at or below it, `low` runs, else `high`.
"""

from __future__ import annotations

import torch

from kiln.ir.plan import Region


class SizeSwitch:
    kind = "switch"

    def __init__(self, region: Region, low, high, low_sizes: dict[str, int]):
        if not low_sizes:
            raise ValueError(f"region {region.name}: a size switch needs a dim to switch on")
        self.region = region
        self.low = low
        self.high = high
        self.low_sizes = {str(s): int(n) for s, n in low_sizes.items()}

    def pick(self, env: dict[str, int]):
        """The kernel that runs at the sizes `env`."""
        if all(int(env[s]) <= n for s, n in self.low_sizes.items()):
            return self.low
        return self.high

    def bind(self, env: dict[str, int], fixed: dict[str, torch.Tensor],
             device: torch.device):
        return self.pick(env).bind(env, fixed, device)

    def run(self, inputs: dict[str, torch.Tensor], outs: dict[str, torch.Tensor],
            env: dict[str, int]) -> None:
        self.pick(env).run(inputs, outs, env)

    def condition(self) -> str:
        """When the low end's kernel runs, e.g. `s0 <= 2`."""
        return " and ".join(f"{s} <= {n}" for s, n in sorted(self.low_sizes.items()))

    def describe(self) -> str:
        low = self.low.describe().rstrip().replace("\n", "\n    ")
        high = self.high.describe().rstrip().replace("\n", "\n    ")
        return (f"size switch: {self.condition()} runs\n    {low}\n"
                f"  larger sizes run\n    {high}")

    def to_json(self) -> dict:
        return {"kind": self.kind, "low_sizes": dict(self.low_sizes),
                "low": self.low.to_json(), "high": self.high.to_json()}
