"""Probe: DeepSeek-V3's absorbed W_UK / W_UV decode GEMVs (batch 1, 128 heads) with the
weights laid out N-contiguous (kiln.models until d919f21) or K-contiguous (kiln.models
since: kv_b_proj's own rows for W_UV, transposed for W_UK); and the router GEMV of bf16
values widened in the kernel. Each kernel launched 24 times in one CUDA graph over 24
weight copies (no L2 reuse), median of 20 replays, us a launch (RESULTS.md, fourteenth
session). Run from the repo root:
PYTHONPATH=. python benchmarks/probes/absorbed_weight_layout.py"""

import sys

import torch
import torch.nn.functional as F

import kiln
from kiln.codegen.build.triton_kernel import TritonKernel

H, NOPE, R, V, D, E = 128, 128, 512, 128, 7168, 256
COPIES = 24


class Ein(torch.nn.Module):
    def __init__(self, eq):
        super().__init__()
        self.eq = eq

    def forward(self, x, w):
        return torch.einsum(self.eq, x, w)


class Router(torch.nn.Module):
    def forward(self, x, w):
        return F.linear(x.float(), w.float()).sigmoid()


def graph_us(exe, x, ws):
    plan = exe.plan
    products = ("aten.bmm.default", "aten.mm.default")
    (region,) = [r for r in plan.regions if any(o.target in products for o in r.ops)]
    kernel = exe.program.kplan.kernels[region.name]
    names = plan.user_inputs
    outs = {o: torch.empty(tuple(int(d) for d in plan.values[o].shape),
                           dtype=plan.values[o].dtype, device="cuda") for o in region.outputs}
    def call(w):
        given = dict(zip(names, (x, w)))
        kernel.run({v: given[v] for v in region.inputs}, outs, {})
    for w in ws[:2]:
        call(w)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in ws:
            call(w)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(ws))
    times.sort()
    cfg = kernel.config if isinstance(kernel, TritonKernel) else type(kernel).__name__
    return times[len(times) // 2], cfg


def case(name, mod, x, w, bytes_):
    exe = kiln.compile(mod, (x, w), target="cuda")
    ws = [w.clone() for _ in range(COPIES)]
    out, ref = exe(x, w), mod(x, w)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    us, cfg = graph_us(exe, x, ws)
    print(f"{name:28s} {us:7.2f} us  bytes {bytes_ / 1e6:5.1f} MB  "
          f"floor {bytes_ / BW * 1e6:5.2f} us  err {err:.1e}  [{cfg}]", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    from triton.testing import do_bench
    BW = 2 * (1 << 30) / (do_bench(lambda: dst.copy_(src)) * 1e-3)
    del src, dst
    print(f"copy {BW / 1e9:.0f} GB/s")
    bf = torch.bfloat16
    q = torch.randn(1, 1, H, NOPE, device="cuda", dtype=bf)
    y = torch.randn(1, 1, H, R, device="cuda", dtype=bf)
    wb = H * NOPE * R * 2

    def w(*shape):
        return torch.randn(*shape, device="cuda", dtype=bf) * 0.05

    case("W_UK [h, nope, r] (kiln)", Ein("bthn,hnr->bthr"), q, w(H, NOPE, R), wb)
    case("W_UK [h, r, nope] (K-contig)", Ein("bthn,hrn->bthr"), q, w(H, R, NOPE), wb)
    case("W_UV [h, r, v] (kiln)", Ein("bthr,hrv->bthv"), y, w(H, R, V), wb)
    case("W_UV [h, v, r] (K-contig)", Ein("bthr,hvr->bthv"), y, w(H, V, R), wb)
    x = torch.randn(1, D, device="cuda", dtype=bf)
    case("router bf16 widened",
         Router(), x, torch.randn(E, D, device="cuda", dtype=bf) * 0.05, E * D * 2)
    case("router fp32 weight", Router(), x, torch.randn(E, D, device="cuda") * 0.05, E * D * 4)
    sys.exit(0)
