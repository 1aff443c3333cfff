"""Probe: kiln's grouped GEMM by offsets against cuBLAS's (aten._grouped_mm) and
transformers' own loop (transformers::grouped_mm_fallback), on MoE expert shapes.

Why: transformers 5's MoE layers run their experts through a grouped GEMM by offsets;
kiln generates it since the eighteenth session (codegen/templates/grouped_mm.py), timed
nowhere yet. Each row: one product x [rows, K] (sorted by expert, rows spread over the
experts with some empty) times w [E, K, N] stored [E, N, K] and transposed (as
transformers passes it), bf16; times from a CUDA graph replay (kiln, cuBLAS) or
the wall clock (transformers' loop syncs on offs.tolist()), and the bytes floor of the
experts' weights that have rows.

GPU:  PYTHONPATH=. python benchmarks/probes/grouped_mm.py [--out f.json]
CPU smoke: PYTHONPATH=. python benchmarks/probes/grouped_mm.py --device cpu --shapes tiny
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

import kiln
from benchmarks.probes.extern_timing import graph_ms  # a CUDA graph's replay, per call

SHAPES = {  # name: (experts, K, N, rows)
    "qwen3moe_gate_up_decode": (128, 2048, 1536, 8),
    "qwen3moe_down_decode": (128, 768, 2048, 8),
    "qwen3moe_gate_up_prefill": (128, 2048, 1536, 16384),
    "qwen3moe_down_prefill": (128, 768, 2048, 16384),
    "mixtral_w13_prefill": (8, 4096, 28672, 4096),
    "tiny": (4, 32, 48, 10),
}


class Grouped(nn.Module):
    def __init__(self, experts: int, k: int, n: int, dtype):
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, n, k, dtype=dtype) * 0.02)

    def forward(self, x, offs):
        return torch.ops.aten._grouped_mm(x, self.w.transpose(1, 2), offs)


def _offsets(rows: int, experts: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 3, (experts,), generator=gen).float() + (
        torch.rand(experts, generator=gen) < 0.75).float() * 4
    counts[0] += 1
    return (counts.cumsum(0) * rows / counts.sum()).round().to(torch.int32).to(device)


def wall_ms(fn, device: str, reps: int = 10) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def _row(name: str, device: str, target: str, copy_gbs: float | None) -> dict:
    """One shape: kiln's error against cuBLAS's, and (GPU) each form's ms."""
    experts, k, n, rows = SHAPES[name]
    model = Grouped(experts, k, n, torch.bfloat16).to(device)
    offs = _offsets(rows, experts, device)
    x = torch.randn(rows, k, dtype=torch.bfloat16, device=device)
    t0 = time.perf_counter()
    exe = kiln.compile(model, (x, offs), target=target)
    compile_s = time.perf_counter() - t0
    got, want = exe(x, offs), model(x, offs)
    owned = int(offs[-1])  # ATen leaves the rows past the last offset unwritten
    err = ((got[:owned].float() - want[:owned].float()).norm()
           / want[:owned].float().norm()).item()
    row = {"shape": name, "experts": experts, "k": k, "n": n, "rows": rows,
           "compile_s": compile_s, "rel_err": err}
    if copy_gbs is not None:
        used = int((offs.diff(prepend=offs.new_zeros(1)) > 0).sum())
        row["floor_ms"] = used * k * n * 2 / (copy_gbs * 1e9) * 1e3
        row["kiln_ms"] = graph_ms(lambda: exe(x, offs))
        row["cublas_ms"] = graph_ms(lambda: model(x, offs))
        try:
            from transformers.integrations import moe  # noqa: F401 - registers the op
        except ImportError:
            pass
        else:
            loop, w = torch.ops.transformers.grouped_mm_fallback, model.w.transpose(1, 2)
            row["transformers_loop_ms"] = wall_ms(lambda: loop(x, w, offs), device)
    print(json.dumps({key: (round(v, 4) if isinstance(v, float) else v)
                      for key, v in row.items()}), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", nargs="+", default=[s for s in SHAPES if s != "tiny"],
                    choices=list(SHAPES))
    ap.add_argument("--out")
    a = ap.parse_args()
    gpu = a.device == "cuda"
    target = "cuda" if gpu else "interpret"
    copy_gbs = None
    if gpu:
        buf = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
        copy_gbs = 2 * buf.numel() / graph_ms(lambda: buf.clone(), reps=5) / 1e6
    with torch.no_grad():
        rows_out = [_row(name, a.device, target, copy_gbs) for name in a.shapes]
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if gpu else "cpu",
                       "copy_GBps": copy_gbs, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
