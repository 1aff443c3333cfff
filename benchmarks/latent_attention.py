"""MLA's absorbed decode on the local GPU: kiln's latent attention kernel against the torch
forms, and against the floor of the bytes a step must read (issue 13).

DeepSeek-V3's widths: 128 heads, a 512-wide latent (the value too) and a 64-wide rotary
key per cached token, bf16; one query per row (decode) at context 128, 2048 and 8192,
batch 1 and 8, every row at the same context. The cache is paged (blocks of
--block-size tokens, the table's blocks shuffled in a pool) or contiguous, sized to the
context. Timed per shape:

- kiln: kiln.compile of a module calling kiln.ops.latent_attention (target cuda): the
  module call, and its kernel launched alone;
- torch einsum: the absorbed form as torch ops, as the model ran it before the op
  (gather each row's blocks, the scores of both parts by einsum, softmax in fp32, the
  weighted latents by einsum);
- torch sdpa: the op's PyTorch form (gather, concatenate, SDPA with one key head),
  what the CPU target runs.

Every output against an fp32 einsum reference (relative error). The floor: the bytes a
step must move (the cache rows of the context, both parts, once; the queries read, the
output written) at the device's copy bandwidth measured in the same run.

Usage (GPU): PYTHONPATH=. python benchmarks/latent_attention.py --out $OUT/mla.json
Smoke test anywhere: PYTHONPATH=. python benchmarks/latent_attention.py --device cpu --small
(the interpret target, tiny widths).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from measure import copy_bandwidth, rel_err, sync, timed_ms

import kiln
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.ops import latent_attention

V3 = dict(heads=128, latent=512, rope=64, contexts=(128, 2048, 8192), batches=(1, 8))
SMALL = dict(heads=8, latent=32, rope=8, contexts=(40, 100), batches=(1, 2))
SCALE = 0.1352337788608801  # V3's 192 ** -0.5 times YaRN's mscale(40, 1) ** 2


class Contiguous(torch.nn.Module):
    def __init__(self, latent: int):
        super().__init__()
        self.r = latent

    def forward(self, q_latent, q_rope, cache, pos):
        return latent_attention(q_latent, q_rope, cache[..., :self.r], cache[..., self.r:],
                                pos, SCALE)


class Paged(Contiguous):
    def forward(self, q_latent, q_rope, pool, pos, table):
        return latent_attention(q_latent, q_rope, pool[..., :self.r], pool[..., self.r:], pos,
                                SCALE, table)


def make_inputs(B, ctx, heads, latent, rope, dtype, device, paged, block, seed=0):
    """(module, args, rows): rows [B, ctx, latent + rope] is each row's cache in order."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q_latent, q_rope = randn(B, 1, heads, latent), randn(B, 1, heads, rope)
    rows = randn(B, ctx, latent + rope)
    pos = torch.full((B, 1), ctx - 1, device=device)
    if not paged:
        return Contiguous(latent), (q_latent, q_rope, rows, pos), rows
    per_row = -(-ctx // block)
    padded = torch.zeros(B, per_row * block, latent + rope, device=device, dtype=dtype)
    padded[:, :ctx] = rows
    order = torch.randperm(B * per_row, generator=gen) + 1  # block 0 unused, as served
    table = order.view(B, per_row).to(device)
    pool = torch.zeros(B * per_row + 1, block, latent + rope, device=device, dtype=dtype)
    pool[table] = padded.view(B, per_row, block, -1)
    return Paged(latent), (q_latent, q_rope, pool, pos, table), rows


def gathered(args, paged: bool):
    """Each row's cache [B, S, W] as the model's update returned it (S: the table's reach)."""
    if not paged:
        return args[2]
    pool, table = args[2], args[4]
    return pool[table].flatten(1, 2)


def torch_einsum(q_latent, q_rope, cache, pos, latent: int):
    """The absorbed form as torch ops: einsum scores, fp32 softmax, einsum output."""
    c, k_rope = cache[..., :latent], cache[..., latent:]
    scores = (torch.einsum("bthr,bsr->bhts", q_latent, c)
              + torch.einsum("bthp,bsp->bhts", q_rope, k_rope)).float() * SCALE
    keys = torch.arange(cache.shape[1], device=cache.device)
    scores = scores.masked_fill(keys[None, None, None, :] > pos[:, None, :, None],
                                float("-inf"))
    return torch.einsum("bhts,bsr->bthr", scores.softmax(-1).to(c.dtype), c)










def latent_kernel(exe):
    """The kernel kiln chose for the op's region, a description, and the region's notes."""
    for r in exe.program.plan.regions:
        if any(op.target == "kiln.latent_attention.default" for op in r.ops):
            k = exe.program.kplan.kernels[r.name]
            what = f"triton [{k.config}]" if isinstance(k, TritonKernel) else k.kind
            return k, what, list(r.notes)
    return None, "missing", []


def launcher(exe, kernel: TritonKernel, args):
    """A zero-argument launch of the op's kernel on the call's tensors (no runtime)."""
    plan, region = exe.plan, kernel.region
    given = dict(zip(plan.user_inputs, args))
    if any(v not in given for v in region.inputs):  # reads intermediates: time the module
        return lambda: exe(*args)
    inputs = {v: given[v] for v in region.inputs}
    outs = {o: torch.empty(tuple(int(d) for d in plan.values[o].shape),
                           dtype=plan.values[o].dtype, device=args[0].device)
            for o in region.outputs}
    return lambda: kernel.run(inputs, outs, {})


def one_shape(B, ctx, widths, a, dtype, target, options, bandwidth) -> dict:
    heads, latent, rope = widths["heads"], widths["latent"], widths["rope"]
    paged = a.layout == "paged"
    model, args, rows = make_inputs(B, ctx, heads, latent, rope, dtype, a.device, paged,
                                    a.block_size)
    q_latent, q_rope, pos = args[0], args[1], args[3]
    ref = torch_einsum(q_latent.float(), q_rope.float(), rows.float(), pos, latent)
    t0 = time.perf_counter()
    exe = kiln.compile(model, args, target=target, options=options)
    out = exe(*args)
    sync(a.device)
    kernel, what, notes = latent_kernel(exe)
    row = {"batch": B, "context": ctx, "kernel": what, "notes": notes,
           "compile_s": time.perf_counter() - t0, "err": rel_err(out, ref),
           "ms": timed_ms(lambda: exe(*args), a.device)}
    if isinstance(kernel, TritonKernel):
        row["ms_kernel"] = timed_ms(launcher(exe, kernel, args), a.device)

    def run_einsum():
        return torch_einsum(q_latent, q_rope, gathered(args, paged), pos, latent)

    row["err_torch_einsum"] = rel_err(run_einsum(), ref)
    row["ms_torch_einsum"] = timed_ms(run_einsum, a.device)
    row["ms_torch_sdpa"] = timed_ms(lambda: model(*args), a.device)
    e = rows.element_size()
    moved = (B * ctx * (latent + rope) + q_latent.numel() + q_rope.numel()
             + B * heads * latent) * e
    row["bytes"] = moved
    best = min(row["ms"], row.get("ms_kernel", row["ms"]))
    row["kiln_vs_torch_einsum"] = best / row["ms_torch_einsum"]
    if bandwidth is not None:
        row["floor_ms"] = moved / bandwidth * 1e3
        row["ratio_vs_floor"] = best / row["floor_ms"]
    return row


_OUT: list[str] = []


def save(results) -> None:
    if _OUT:
        with open(_OUT[0], "w") as f:
            json.dump(results, f, indent=2, default=str)


def table(results) -> str:
    lines = [f"device: {results['device']}  widths: {results['widths']}  dtype: "
             f"{results['dtype']}  layout: {results['layout']}  copy: "
             f"{results.get('copy_gbs') or float('nan'):.0f} GB/s"]
    lines.append(f"{'B':>3s} {'ctx':>6s} {'kiln ms':>9s} {'kernel':>9s} {'einsum':>9s} "
                 f"{'sdpa':>9s} {'floor':>9s} {'x floor':>8s} {'x einsum':>8s} {'err':>9s}"
                 "  config")
    nan = float("nan")
    for r in results["rows"]:
        lines.append(f"{r['batch']:3d} {r['context']:6d} {r['ms']:9.4f} "
                     f"{r.get('ms_kernel', nan):9.4f} {r['ms_torch_einsum']:9.4f} "
                     f"{r['ms_torch_sdpa']:9.4f} {r.get('floor_ms', nan):9.4f} "
                     f"{r.get('ratio_vs_floor', nan):8.2f} {r['kiln_vs_torch_einsum']:8.2f} "
                     f"{r['err']:9.2e}  {r['kernel']}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="tiny widths (smoke test)")
    ap.add_argument("--contexts", type=int, nargs="+", help="default 128 2048 8192")
    ap.add_argument("--batches", type=int, nargs="+", help="default 1 8")
    ap.add_argument("--layout", default="paged", choices=["paged", "contiguous"])
    ap.add_argument("--block-size", type=int, default=64, help="paged cache block")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--tune", default=None, choices=["none", "fast", "full"])
    a = ap.parse_args()
    widths = dict(SMALL if a.small else V3)
    dtype = getattr(torch, a.dtype)
    target = "cuda" if a.device == "cuda" else "interpret"
    options = {"tune": a.tune} if a.tune else {}
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu (interpret target)"
    results = {"device": name, "dtype": a.dtype, "target": target, "layout": a.layout,
               "block_size": a.block_size if a.layout == "paged" else None,
               "widths": {k: widths[k] for k in ("heads", "latent", "rope")},
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
    with tempfile.TemporaryDirectory() as cache:
        os.environ.setdefault("KILN_CACHE_DIR", cache)
        for ctx in a.contexts or widths["contexts"]:
            for B in a.batches or widths["batches"]:
                results["rows"].append(one_shape(B, ctx, widths, a, dtype, target, options,
                                                 bandwidth))
                save(results)  # each shape's numbers survive a later failure
    print(table(results))


if __name__ == "__main__":
    main()
