"""kiln bench's attention alone, with and without the mask's envelope (issue 10).

gpt-fast's attention at Llama-3-8B's widths (32 heads over 8 KV heads of 128, fp16): SDPA
over a static [1, 8, 2304, 128] cache with the boolean causal mask sliced from a buffer
by the input positions, GQA by repeat_interleave, as kiln/bench/subject.py writes it.
Compiled twice for the local GPU, `options={"mask_envelope": True / False}`
(dispatch/mask_envelope.py), each as prefill (a dynamic query length) and decode (one
query). Per case (prefill 128 / 2048 from position 0, decode at context 128 / 2048):

- each kernel's GPU time in a call (torch.profiler): attention, the envelope (computed
  once per forward, shared by every layer in a model) and the mask's gather;
- the module call (every kernel and the runtime's launches);
- eager SDPA on the same inputs (PyTorch's choice of backend for an explicit mask);

and each output's relative error against eager in fp32. Expected on an H100: prefill 2048
attention about half its time (half of its key blocks are masked out), decode @128 a few
us (the context's 128 keys, not the cache's 2304).

Usage (GPU): PYTHONPATH=. python benchmarks/mask_envelope.py --out $OUT/mask_envelope.json
Smoke test anywhere: PYTHONPATH=. python benchmarks/mask_envelope.py --device cpu --small
(the interpret target, tiny widths).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from measure import rel_err, timed_ms

import kiln
from kiln.codegen.build.triton_kernel import TritonKernel

FULL = dict(heads=32, kv_heads=8, head_dim=128, cache=2304, prefill=(128, 2048),
            decode=(128, 2048), dtype=torch.float16)
SMALL = dict(heads=4, kv_heads=2, head_dim=16, cache=96, prefill=(16, 70), decode=(20, 90),
             dtype=torch.float32)


class Attention(torch.nn.Module):
    def __init__(self, cache: int):
        super().__init__()
        self.register_buffer("causal", torch.tril(torch.ones(cache, cache, dtype=torch.bool)))

    def forward(self, q, k_cache, v_cache, input_pos):
        mask = self.causal[None, None, input_pos]
        rep = q.shape[1] // k_cache.shape[1]
        k = k_cache.repeat_interleave(rep, dim=1)
        v = v_cache.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def inputs(w, t: int, start: int, device: str):
    g = torch.Generator(device="cpu").manual_seed(t * 7919 + start)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device, w["dtype"])

    cache = (1, w["kv_heads"], w["cache"], w["head_dim"])
    return (rnd(1, w["heads"], t, w["head_dim"]), rnd(*cache), rnd(*cache),
            torch.arange(start, start + t, device=device))


def kernels(exe):
    """{'attention': kernel, 'envelope': kernel or None} of a compiled module."""
    out = {"attention": None, "envelope": None}
    for r in exe.plan.regions:
        k = exe.program.kplan.kernels[r.name]
        if r.kind.value == "attention":
            out["attention"] = k
        elif r.key_bounds is None and any(o.endswith(("_key_start", "_key_end"))
                                          for o in r.outputs):
            out["envelope"] = k
    return out


def run_case(w, exe, phase: str, t: int, start: int, device: str, env_on: bool) -> dict:
    args = inputs(w, t, start, device)
    model = Attention(w["cache"]).to(device)
    ref = model(*(a.float() if a.is_floating_point() else a for a in args))
    out = exe(*args)
    row = {"phase": phase, "t": t, "context": start + t, "envelope": env_on,
           "err": rel_err(out.float(), ref), "ms_call": timed_ms(lambda: exe(*args), device)}
    ks = kernels(exe)
    for name, k in ks.items():
        if isinstance(k, TritonKernel):
            row[f"{name}_kernel"] = str(k.config)
    row["ms_eager"] = timed_ms(lambda: model(*args), device)
    return row


def profile_kernels(exe, args, device: str) -> dict[str, float]:
    """Per-kernel GPU ms of one call (torch.profiler), by region kind ("attention",
    "envelope", "copy": the mask's gather)."""
    if device != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        exe(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            exe(*args)
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA":
            # kiln's kernels are named kiln_<region kind>_...: the envelope is the reduction
            kind = e.key.split("_")[1] if e.key.startswith("kiln_") else e.key[:40]
            key = {"reduction": "envelope"}.get(kind, kind)
            out[key] = out.get(key, 0.0) + e.device_time_total / 20 / 1000
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    w = SMALL if a.small else FULL
    target = "cuda" if a.device == "cuda" else "interpret"
    rows = []
    T = torch.export.Dim("T", min=2, max=w["cache"])
    for env_on in (False, True):
        opts = {"mask_envelope": env_on}
        model = Attention(w["cache"]).to(a.device)
        pre = kiln.compile(model, inputs(w, 16, 0, a.device), target=target, options=opts,
                           dynamic_shapes=({2: T}, None, None, {0: T}))
        dec = kiln.compile(model, inputs(w, 1, 0, a.device), target=target, options=opts)
        for phase, exe, t, starts in (("prefill", pre, None, w["prefill"]),
                                      ("decode", dec, 1, w["decode"])):
            for n in starts:
                tt, start = (n, 0) if t is None else (1, n - 1)
                row = run_case(w, exe, phase, tt, start, a.device, env_on)
                row["gpu_ms"] = profile_kernels(exe, inputs(w, tt, start, a.device), a.device)
                rows.append(row)
                print(json.dumps(row))
    print(f"\n{'phase':8s} {'ctx':>5s} {'env':>4s} {'call ms':>9s} {'attn ms':>9s} "
          f"{'env ms':>9s} {'eager ms':>9s} {'err':>9s}")
    for r in rows:
        g = r["gpu_ms"]
        print(f"{r['phase']:8s} {r['context']:5d} {str(r['envelope']):>5s} {r['ms_call']:9.4f} "
              f"{g.get('attention', float('nan')):9.4f} {g.get('envelope', float('nan')):9.4f} "
              f"{r['ms_eager']:9.4f} {r['err']:9.2e}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
