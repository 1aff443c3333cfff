"""Probe: the gathered experts' down projection at decode (Qwen3-Next widths: dim 2048,
I 512, 10 chosen of 512 experts, bf16, batch 1) in two forms, each compiled by kiln:

- `split`: each chosen expert's down product [10, dim] by one reduction over I, then
  the weighted sum over the experts by a second kernel (kiln.models.moe until now);
- `fused`: h scaled by each expert's weight where h is made, then one reduction over
  (expert, I) per output column: the weighted sum inside the down product's kernel.

Each call is captured 8 times in one CUDA graph, each with other experts (no L2 reuse
of the 21 MB read), median of 20 replays; us a call, every kernel of the module (the
gate/up kernel included, the same in both). Run from the repo root:
PYTHONPATH=. python benchmarks/probes/gathered_down.py [--tune none|fast]"""

import argparse

import torch
import torch.nn.functional as F

import kiln

DIM, INTER, E, K = 2048, 512, 512, 10
CALLS = 8


class Gathered(torch.nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.gate = torch.nn.Parameter(torch.randn(E, INTER, DIM) * DIM ** -0.5)
        self.up = torch.nn.Parameter(torch.randn(E, INTER, DIM) * DIM ** -0.5)
        self.down = torch.nn.Parameter(torch.randn(E, DIM, INTER) * INTER ** -0.5)

    def forward(self, x, ids, weights):
        xf = x.float()[:, None, None, :]
        g = (xf * self.gate[ids].float()).sum(-1)
        u = (xf * self.up[ids].float()).sum(-1)
        h = (F.silu(g) * u).to(x.dtype).float()
        if self.form == "split":
            y = (h[:, :, None, :] * self.down[ids].float()).sum(-1)
            return (y * weights[:, :, None]).sum(1).to(x.dtype)
        hw = h * weights[:, :, None]
        if self.form == "fused16":  # hw stored in x's dtype: half the bytes each program reads
            hw = hw.to(x.dtype).float()
        down = self.down[ids].float().transpose(-3, -2)
        return (hw[:, None, :, :] * down).sum((-2, -1)).to(x.dtype)


def graph_us(exe, calls) -> float:
    for args in calls:  # load the kernels, settle the allocations
        exe(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in calls:
            exe(*args)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tune", default="none")
    a = ap.parse_args()
    torch.manual_seed(0)
    base = Gathered("split").to(torch.bfloat16).cuda()
    gen = torch.Generator().manual_seed(1)
    calls = [(torch.randn(1, DIM, generator=gen).to(torch.bfloat16).cuda(),
              torch.randperm(E, generator=gen)[:K][None].cuda(),
              torch.rand(1, K, generator=gen).cuda()) for _ in range(CALLS)]
    ref_model = Gathered("split").cuda()  # fp32, the same weights
    ref_model.load_state_dict({k: v.float() for k, v in base.state_dict().items()})
    with torch.no_grad():
        want = ref_model(calls[0][0].float(), *calls[0][1:])
    del ref_model
    for form in ("split", "fused", "fused16"):
        model = Gathered(form).to(torch.bfloat16).cuda()
        model.load_state_dict(base.state_dict())
        exe = kiln.compile(model, calls[0], target="cuda", options={"tune": a.tune})
        with torch.no_grad():
            out = exe(*calls[0]).float()
        err = ((out - want).norm() / want.norm()).item()
        us = graph_us(exe, calls)
        kernels = ", ".join(exe.program.kplan.kernels[r.name].spec.name
                            for r in exe.plan.regions)
        print(f"{form:<8} {us:7.2f} us  rel err vs fp32 {err:.1e}  "
              f"{len(exe.plan.regions)} kernels: {kernels}")
        del exe, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
