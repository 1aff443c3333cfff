"""DeepSeek-V3's routed experts on the local GPU: kiln's grouped MoE kernel against the
torch forms and the floor of the bytes a call must read (issue 13).

V3's widths: dim 7168, 256 experts of width 2048, top 8, bf16 (22.5 GB of expert
weights); N = 1, 8, 128 and 2048 tokens, each choosing 8 distinct experts uniformly at
random (routing weights random, fp32). Timed per N:

- kiln: kiln.compile of a module calling kiln.ops.moe_experts (target cuda, tuned as
  --tune says): the module call, and its kernel launched alone;
- torch sorted: the op's PyTorch form (argsort by expert, one matmul chain per expert
  over its rows, each token's rows summed), what eager grouped MoE code runs;
- torch gathered: each token's chosen experts' weights copied (w[ids]) and run as
  batched matmuls, eager's fastest gathered form, where the copies fit in --gather-gb;
- torch dense: every expert on every token, zero-weighted off the choice (its
  [N, 256, 2048] activations), where they fit in --dense-gb.

--fp8: the experts in block-scaled fp8 as DeepSeek-V3's fp8 release stores them (the
same random weights quantised per expert in 128 x 128 blocks, kiln.ops.quantize_experts;
11.3 GB), run by kiln.ops.moe_experts_fp8: kiln's fp8 grouped kernel against the op's
PyTorch form ("torch sorted": every product kiln::fp8_linear's); no gathered or dense
torch form (they would need the weights dequantised).

--forms (with --fp8): the fp8 kernel also rebuilt in each of its two forms at that
form's default config, each launched alone: "gemv" (decode's CUDA-core K loops,
templates/moe/fp8_gemv.py, kiln's choice up to 8 tokens) and "dot" (tl.dot K loops,
templates/moe/fp8.py, the choice above), each against the floor.

Outputs against the torch sorted form (relative error). The floor: the bytes a call
must move, the weights of the experts the routing chose (each once: gate, up and down;
1 byte a weight with --fp8, plus their fp32 block scales) plus x read and y written,
at the device's copy bandwidth measured in the same run; TFLOP/s counts
6 * N * k * I * dim (the routed products).

Usage (GPU): PYTHONPATH=. python benchmarks/moe_experts.py --out $OUT/moe.json
             PYTHONPATH=. python benchmarks/moe_experts.py --fp8 --out $OUT/moe_fp8.json
             PYTHONPATH=. python benchmarks/moe_experts.py --fp8 --forms --tokens 1 8 \
                 --out $OUT/moe_fp8_forms.json
             (--tune none: kiln's untuned heuristic config)
Smoke test anywhere: PYTHONPATH=. python benchmarks/moe_experts.py --device cpu --small
[--fp8] (the interpret target, tiny widths; --fp8 at dim 256 / I 128, whole blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.nn.functional as F
from measure import copy_bandwidth, rel_err, timed_ms

import kiln
from kiln.codegen.build.compiler import compile_binary
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.codegen.templates.moe import template as moe_template
from kiln.ops import moe_experts, moe_experts_fp8, quantize_experts
from kiln.target import get_target

V3 = dict(dim=7168, inter=2048, experts=256, top_k=8, tokens=(1, 8, 128, 2048))
SMALL = dict(dim=64, inter=32, experts=8, top_k=2, tokens=(1, 8, 24))
SMALL_FP8 = dict(dim=256, inter=128, experts=4, top_k=2, tokens=(1, 8))
OPS = ("kiln.moe_experts.default", "kiln.moe_experts_fp8.default")


class Experts(torch.nn.Module):
    op = staticmethod(torch.ops.kiln.moe_experts)

    def __init__(self, gate, up, down):
        super().__init__()
        self.gate, self.up, self.down = (torch.nn.Parameter(t, requires_grad=False)
                                         for t in (gate, up, down))

    def operands(self):
        return self.gate, self.up, self.down

    def forward(self, x, weights, ids):
        return moe_experts(x, weights, ids, *self.operands())


class Fp8Experts(torch.nn.Module):
    """`experts` quantised per expert in 128 x 128 blocks (e4m3 and fp32 scales)."""

    op = staticmethod(torch.ops.kiln.moe_experts_fp8)

    def __init__(self, experts: Experts):
        super().__init__()
        for name in ("gate", "up", "down"):
            q, scale = quantize_experts(getattr(experts, name))
            setattr(self, name, torch.nn.Parameter(q, requires_grad=False))
            setattr(self, f"{name}_scale", torch.nn.Parameter(scale, requires_grad=False))

    def operands(self):
        return (self.gate, self.gate_scale, self.up, self.up_scale, self.down,
                self.down_scale)

    def forward(self, x, weights, ids):
        return moe_experts_fp8(x, weights, ids, *self.operands())


def make_experts(w, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    E, inter, dim = w["experts"], w["inter"], w["dim"]

    def randn(*shape, scale):
        return (torch.randn(*shape, generator=gen, device=device, dtype=dtype) * scale)

    return Experts(randn(E, inter, dim, scale=dim ** -0.5), randn(E, inter, dim,
                                                                   scale=dim ** -0.5),
                   randn(E, dim, inter, scale=inter ** -0.5))


def make_inputs(N, w, dtype, device, seed=1):
    """x [N, dim], weights [N, k] (fp32, summing to 2.5 as V3's are scaled), ids [N, k]
    (k distinct experts per token, uniformly)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(N, w["dim"], generator=gen).to(device=device, dtype=dtype)
    ids = torch.rand(N, w["experts"], generator=gen).argsort(-1)[:, :w["top_k"]]
    weights = torch.rand(N, w["top_k"], generator=gen)
    weights = weights / weights.sum(-1, keepdim=True) * 2.5
    return x, weights.to(device), ids.to(device)


def torch_gathered(m, x, weights, ids):
    h = F.silu(torch.einsum("nd,nkid->nki", x, m.gate[ids]))
    h = h * torch.einsum("nd,nkid->nki", x, m.up[ids])
    y = torch.einsum("nki,nkdi->nkd", h, m.down[ids])
    return (y.float() * weights[:, :, None]).sum(1).to(x.dtype)


def torch_dense(m, x, weights, ids):
    combine = torch.zeros(x.shape[0], m.gate.shape[0], dtype=torch.float32,
                          device=x.device).scatter(1, ids, weights)
    h = F.silu(torch.einsum("nd,eid->nei", x, m.gate))
    h = h * torch.einsum("nd,eid->nei", x, m.up)
    y = torch.einsum("nei,edi->ned", h, m.down)
    return (y.float() * combine[:, :, None]).sum(1).to(x.dtype)








def moe_kernel(exe):
    """The kernel kiln chose for the op's region, a description, and the region's notes."""
    for r in exe.program.plan.regions:
        if any(op.target in OPS for op in r.ops):
            k = exe.program.kplan.kernels[r.name]
            what = f"triton [{k.config}]" if isinstance(k, TritonKernel) else k.kind
            return k, what, list(r.notes)
    return None, "missing", []


def launcher(exe, kernel: TritonKernel, args, outs=None):
    """A zero-argument launch of the op's kernel on the call's tensors (no runtime);
    `outs`, when given a dict, is filled with its output tensors."""
    plan, region = exe.plan, kernel.region
    given = dict(zip(plan.user_inputs, args))
    given.update({v: exe.state[plan.values[v].target] for v in region.inputs
                  if plan.values[v].target in exe.state})  # weights by their names
    if any(v not in given for v in region.inputs):  # reads intermediates: time the module
        return lambda: exe(*args)
    inputs = {v: given[v] for v in region.inputs}
    made = {o: torch.empty(tuple(int(d) for d in plan.values[o].shape),
                           dtype=plan.values[o].dtype, device=args[0].device)
            for o in region.outputs}
    if outs is not None:
        outs.update(made)
    return lambda: kernel.run(inputs, made, {})


def form_rows(exe, kernel: TritonKernel, args, ref, device) -> dict:
    """--forms: the fp8 kernel rebuilt in each form at its default config, timed alone
    (ms, relative error against the torch form, registers and spills on a GPU)."""
    target = get_target("cuda" if device == "cuda" else "interpret")
    rows = {}
    for form in ("gemv", "dot"):
        try:
            spec = moe_template.generate(kernel.region, exe.program.plan, target, form=form)
            row = {"config": str(spec.default)}
            if device == "cuda":
                binary = compile_binary(spec, spec.default, target)
                k = TritonKernel(kernel.region, spec, spec.default, binary)
                row.update(registers=binary.resources.registers,
                           spills=binary.resources.spills)
            else:
                k = TritonKernel(kernel.region, spec, spec.default, interpret=True)
            outs: dict = {}
            run = launcher(exe, k, args, outs)
            run()
            row["err"] = rel_err(next(iter(outs.values())), ref)
            row["ms"] = timed_ms(run, device)
            rows[form] = row
        except Exception as e:  # one form failing must not hide the other
            rows[form] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return rows


def floor_bytes(m, x, ids) -> int:
    """The chosen experts' weights (gate, up and down, each once; fp8: with their block
    scales), x read, y written."""
    experts = int(torch.unique(ids).numel())
    per_expert = sum(t[0].numel() * t.element_size() for t in m.operands())
    return experts * per_expert + 2 * x.numel() * x.element_size()


def one_shape(N, w, m, a, dtype, target, options, bandwidth) -> dict:
    args = make_inputs(N, w, dtype, a.device)
    x, weights, ids = args
    ref = m.op(x, weights, ids, *m.operands())
    t0 = time.perf_counter()
    exe = kiln.compile(m, args, target=target, options=options)
    out = exe(*args)
    if a.device == "cuda":
        torch.cuda.synchronize()
    kernel, what, notes = moe_kernel(exe)
    row = {"tokens": N, "kernel": what, "notes": notes,
           "compile_s": time.perf_counter() - t0, "err": rel_err(out, ref),
           "ms": timed_ms(lambda: exe(*args), a.device)}
    if isinstance(kernel, TritonKernel):
        row["ms_kernel"] = timed_ms(launcher(exe, kernel, args), a.device)
    if a.forms and isinstance(kernel, TritonKernel):
        row["forms"] = form_rows(exe, kernel, args, ref, a.device)
    row["ms_torch_sorted"] = timed_ms(lambda: m.op(x, weights, ids, *m.operands()), a.device)
    e, k = x.element_size(), w["top_k"]
    copies = 3 * N * k * w["inter"] * w["dim"] * e
    if not a.fp8 and copies <= a.gather_gb * 2**30:
        row["err_torch_gathered"] = rel_err(torch_gathered(m, *args), ref)
        row["ms_torch_gathered"] = timed_ms(lambda: torch_gathered(m, *args), a.device)
    activations = N * w["experts"] * (2 * w["inter"] + w["dim"]) * e
    if not a.fp8 and activations <= a.dense_gb * 2**30:
        row["err_torch_dense"] = rel_err(torch_dense(m, *args), ref)
        row["ms_torch_dense"] = timed_ms(lambda: torch_dense(m, *args), a.device)
    best = min(row["ms"], row.get("ms_kernel", row["ms"]))
    torch_best = min(row[c] for c in ("ms_torch_sorted", "ms_torch_gathered",
                                      "ms_torch_dense") if c in row)
    row["kiln_vs_best_torch"] = best / torch_best
    row["bytes"] = floor_bytes(m, x, ids)
    row["tflops"] = 6 * N * k * w["inter"] * w["dim"] / (best * 1e-3) / 1e12
    if bandwidth is not None:
        row["floor_ms"] = row["bytes"] / bandwidth * 1e3
        row["ratio_vs_floor"] = best / row["floor_ms"]
        for f in row.get("forms", {}).values():
            if "ms" in f:
                f["x_floor"] = f["ms"] / row["floor_ms"]
    return row


_OUT: list[str] = []


def save(results) -> None:
    if _OUT:
        with open(_OUT[0], "w") as f:
            json.dump(results, f, indent=2, default=str)


def table(results) -> str:
    lines = [f"device: {results['device']}  widths: {results['widths']}  dtype: "
             f"{results['dtype']}{' fp8 experts' if results['fp8'] else ''}  tune: "
             f"{results['tune']}  copy: "
             f"{results.get('copy_gbs') or float('nan'):.0f} GB/s"]
    lines.append(f"{'N':>5s} {'kiln ms':>9s} {'kernel':>9s} {'sorted':>9s} {'gathered':>9s} "
                 f"{'dense':>9s} {'floor':>9s} {'x floor':>8s} {'x torch':>8s} {'TFLOP/s':>8s} "
                 f"{'err':>9s}  config")
    nan = float("nan")
    for r in results["rows"]:
        lines.append(f"{r['tokens']:5d} {r['ms']:9.4f} {r.get('ms_kernel', nan):9.4f} "
                     f"{r['ms_torch_sorted']:9.4f} {r.get('ms_torch_gathered', nan):9.4f} "
                     f"{r.get('ms_torch_dense', nan):9.4f} {r.get('floor_ms', nan):9.4f} "
                     f"{r.get('ratio_vs_floor', nan):8.2f} {r['kiln_vs_best_torch']:8.2f} "
                     f"{r['tflops']:8.1f} {r['err']:9.2e}  {r['kernel']}")
        for form, f in r.get("forms", {}).items():
            if "error" in f:
                lines.append(f"{'':5s}   {form}: ERROR {f['error'][:160]}")
                continue
            regs = f" regs {f['registers']} spills {f['spills']}" if "registers" in f else ""
            lines.append(f"{'':5s}   {form:4s} {f['ms']:9.4f} ms  x floor "
                         f"{f.get('x_floor', nan):5.2f}  err {f['err']:.2e}  "
                         f"[{f['config']}]{regs}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="tiny widths (smoke test)")
    ap.add_argument("--fp8", action="store_true",
                    help="block-scaled fp8 experts (kiln.ops.moe_experts_fp8)")
    ap.add_argument("--forms", action="store_true",
                    help="with --fp8: time the kernel's GEMV and tl.dot forms too")
    ap.add_argument("--tokens", type=int, nargs="+", help="default 1 8 128 2048")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--tune", default=None, choices=["none", "fast", "full"],
                    help="kiln's tuning (default: kiln's own, fast)")
    ap.add_argument("--gather-gb", type=float, default=16.0,
                    help="run the gathered form where its weight copies fit in this")
    ap.add_argument("--dense-gb", type=float, default=16.0,
                    help="run the dense form where its activations fit in this")
    a = ap.parse_args()
    widths = dict((SMALL_FP8 if a.fp8 else SMALL) if a.small else V3)
    dtype = getattr(torch, a.dtype)
    target = "cuda" if a.device == "cuda" else "interpret"
    options = {"tune": a.tune} if a.tune else {}
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu (interpret target)"
    results = {"device": name, "dtype": a.dtype, "fp8": a.fp8, "target": target,
               "tune": a.tune or "fast",
               "widths": {k: widths[k] for k in ("dim", "inter", "experts", "top_k")},
               "torch": torch.__version__, "rows": []}
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        pass
    if a.out:
        _OUT.append(a.out)
    bandwidth = copy_bandwidth(a.device)
    results["copy_gbs"] = bandwidth / 1e9 if bandwidth else None
    m = make_experts(widths, dtype, a.device)
    if a.fp8:
        m = Fp8Experts(m)  # the bf16 weights are freed
        if a.device == "cuda":
            torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as cache:
        os.environ.setdefault("KILN_CACHE_DIR", cache)
        for N in a.tokens or widths["tokens"]:
            results["rows"].append(one_shape(N, widths, m, a, dtype, target, options,
                                             bandwidth))
            save(results)  # each shape's numbers survive a later failure
    print(table(results))


if __name__ == "__main__":
    main()
