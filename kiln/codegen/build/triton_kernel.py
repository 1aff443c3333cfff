"""TritonKernel: a region's generated kernel at its chosen config, ready to launch.

On a GPU it launches the compiled binary (no JIT, so a loaded artifact never
recompiles); on the `interpret` target it runs the same source through Triton's
interpreter on CPU tensors.

Scratch buffers the spec asks for are allocated here, on the device of the kernel's
tensors, and shared by every kernel of the process on that device: kiln runs a
device's kernels one after another on one stream, and a kernel leaves its zeroed
buffers zero again, so one set serves all (a model's 32 layers do not each hold
their own). A launch that needs more allocates a larger buffer and keeps the old one
alive: a CUDA graph captured earlier still points at it.
"""

from __future__ import annotations

import torch

from kiln.codegen.build.compiler import Binary
from kiln.codegen.build.source import load_kernel
from kiln.codegen.build.spec import Config, KernelSpec, Scratch
from kiln.ir.plan import Region
from kiln.ir.symbolic import evaluate

_SCRATCH: dict[tuple, list[torch.Tensor]] = {}


def scratch_buffer(b: Scratch, position: int, numel: int, device) -> torch.Tensor:
    """The shared buffer for a kernel's `position`-th scratch, at least `numel` long."""
    kept = _SCRATCH.setdefault((str(device), b.dtype, b.zeroed, position), [])
    if not kept or kept[-1].numel() < numel:
        make = torch.zeros if b.zeroed else torch.empty
        kept.append(make(numel, dtype=b.dtype, device=device))
    return kept[-1]


class TritonKernel:
    kind = "triton"

    def __init__(self, region: Region, spec: KernelSpec, config: Config,
                 binary: Binary | None = None, interpret: bool = False):
        self.region = region
        self.spec = spec
        self.config = config
        self.binary = binary
        self.interpret = interpret
        self._tunables = [config[t] for t in spec.tunables]
        self._params = config.as_dict()
        self._fn = load_kernel(spec.source, spec.name, interpret=True) if interpret else None
        if not interpret and binary is None:
            raise ValueError(f"kernel {spec.name} needs a compiled binary to run on a GPU")

    def _args(self, inputs, outs, env):
        args, sizes = [], {}
        for a in self.spec.args:
            if a.kind == "tensor":
                t = outs[a.value] if a.value in outs else inputs[a.value]
                if a.value not in outs and (not t.is_contiguous() or t.data_ptr() % 16):
                    t = t.contiguous().clone()  # kernels assume dense, 16-byte-aligned inputs
                args.append(t)
            elif a.kind == "size":
                v = evaluate(a.expr, env)
                sizes[a.name] = v
                args.append(v)
            else:
                args.append(a.expr)
        if self.spec.scratch:
            device = next((x.device for x in args if isinstance(x, torch.Tensor)), "cpu")
            args += [scratch_buffer(b, i, b.numel_for(sizes, self.config), device)
                     for i, b in enumerate(self.spec.scratch)]
        return args + self._tunables, sizes

    def run(self, inputs: dict[str, torch.Tensor], outs: dict[str, torch.Tensor],
            env: dict[str, int]) -> None:
        args, sizes = self._args(inputs, outs, env)
        for v in self.spec.zero_outputs:  # the kernel adds partial results into these
            outs[v].zero_()
        grid = self.spec.grid_for(sizes, self.config, self._params)
        if 0 in grid:
            return
        if self.interpret:
            self._fn[grid](*args, num_warps=self.config.num_warps,
                           num_stages=self.config.num_stages)
        else:
            self.binary.kernel(self.spec, self.config)[grid](*args)

    def describe(self) -> str:
        res = self.binary.resources if self.binary else None
        head = f"triton {self.spec.template} kernel {self.spec.name} [{self.config}]"
        if res is not None:
            head += (f" shared={res.shared}B regs={res.registers} spills={res.spills}")
        return head + "\n" + self.spec.source

    def to_json(self) -> dict:
        return {"kind": self.kind, "spec": self.spec.to_json(), "config": self.config.to_json()}
