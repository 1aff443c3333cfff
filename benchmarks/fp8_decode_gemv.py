"""The fp8 linear at decode's token counts against its byte floor (issue 13): the GEMV
form (CUDA cores, templates/fp8_matmul/gemv.py) and the two tensor-core forms (tokens
or weight rows as the dot's rows: "dot", "swap"), each at its default config (what
`tune none`, kiln.models.load's choice, runs), and kiln's tuned module, on the
DeepSeek-V3 slice's and Llama-3-8B's fp8 shapes.

Each kernel is timed alone by the profiler (its device time: launch gaps excluded,
as in a decode step's CUDA graph; L2 flushed before each call: a decode step streams
~4 GB, so no weight is in L2 when its linear runs), and divided
by its floor: the weight's bytes (plus x, scales, output) at the device copy rate
measured in the same run (measure.copy_bandwidth, 1 GiB read + write). Every output
is checked against the op's PyTorch form.

GPU: PYTHONPATH=. python benchmarks/fp8_decode_gemv.py --out $OUT/fp8_decode_gemv.json
     (--tokens 1 2 4 8, --shapes o dense_up ..., --no-tune to skip the tuned module)
Smoke test anywhere: PYTHONPATH=. python benchmarks/fp8_decode_gemv.py --device cpu --small
"""

from __future__ import annotations

import argparse
import json

import torch
from fp8_gemm import Linear, gemm_region, region_inputs, region_outputs
from measure import copy_bandwidth, rel_err, sync, timed_ms

import kiln
from kiln.codegen.build.compiler import compile_binary
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.codegen.templates.fp8_matmul import template
from kiln.ops import quantize_weight
from kiln.target import get_target

# (N, K) of the slice's fp8 linears (V3 widths): MLA's projections, the dense layer's
# MLP, the shared expert
SHAPES = {"q_a": (1536, 7168), "kv_a": (576, 7168), "q_b": (24576, 1536),
          "o": (7168, 16384), "dense_up": (18432, 7168), "dense_down": (7168, 18432),
          "shared_up": (2048, 7168), "shared_down": (7168, 2048),
          # Llama-3-8B's (gpt-fast's fused wqkv and w1/w3)
          "llama_qkv": (6144, 4096), "llama_o": (4096, 4096), "llama_w13": (28672, 4096),
          "llama_w2": (4096, 14336)}
FORMS = ("gemv", "dot", "swap")
SMALL = {"small": (200, 300)}


def form_kernel(exe, form, target, interpret):
    """The op's kernel rebuilt in `form` at that form's default config."""
    region, _ = gemm_region(exe)
    spec = template.generate(region, exe.program.plan, target, form=form)
    if interpret:
        return TritonKernel(region, spec, spec.default, interpret=True), spec.default
    binary = compile_binary(spec, spec.default, target)
    return TritonKernel(region, spec, spec.default, binary), spec.default, binary.resources


def time_kernel(exe, kernel, x, device):
    region, _ = gemm_region(exe)
    inputs, outs = region_inputs(exe, region, x), region_outputs(exe, region, device)

    def run():
        kernel.run(inputs, outs, {})

    run()
    sync(device)
    ms = device_ms(run) if device == "cuda" else timed_ms(run, device)
    return ms, outs[region.outputs[0]]


def device_ms(run, reps: int = 20) -> float:
    """Median device time of `run`'s kernels (the profiler's, launch gaps excluded: a
    decode step replays them back to back in a CUDA graph), L2 flushed before each."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps):
        flush.zero_()
        sync("cuda")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            sync("cuda")
        times.append(sum(e.time_range.elapsed_us() for e in prof.events()
                         if e.device_type.name == "CUDA") / 1e3)
    return sorted(times)[reps // 2]


def run_shape(name, N, K, M, a, rate, rows):
    device = a.device
    target = get_target("cuda" if device == "cuda" else "interpret")
    gen = torch.Generator().manual_seed(0)
    w, ws = (t.to(device) for t in quantize_weight(torch.randn(N, K, generator=gen) * 0.02))
    x = torch.randn(M, K, generator=gen).to(device=device, dtype=torch.bfloat16)
    model = Linear(w, ws)
    want = model(x).float()
    nbytes = N * K + ws.numel() * 4 + M * (K + N) * 2
    floor_ms = nbytes / rate * 1e3 if rate else None
    row = {"shape": name, "M": M, "N": N, "K": K, "bytes": nbytes, "floor_ms": floor_ms}
    exe = kiln.compile(model, (x,), target="cuda" if device == "cuda" else "interpret",
                       options={"tune": "none"})
    for form in FORMS:
        try:
            kernel, config, *res = form_kernel(exe, form, target, device != "cuda")
            ms, out = time_kernel(exe, kernel, x, device)
            row[form] = {"config": str(config), "ms": ms, "rel_err": rel_err(out.float(), want)}
            if res:
                row[form].update(registers=res[0].registers, spills=res[0].spills)
            if floor_ms:
                row[form]["x_floor"] = ms / floor_ms
        except Exception as e:  # one form failing must not hide the other
            row[form] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    if a.tune and device == "cuda":
        tuned = kiln.compile(model, (x,), target="cuda", options={"tune": "fast"})
        _, k = gemm_region(tuned)
        ms, out = time_kernel(tuned, k, x, device)
        row["tuned"] = {"config": str(getattr(k, "config", k)), "ms": ms,
                        "form": k.spec.meta.get("form") if hasattr(k, "spec") else None,
                        "rel_err": rel_err(out.float(), want)}
        if floor_ms:
            row["tuned"]["x_floor"] = ms / floor_ms
    rows.append(row)
    print(_line(row), flush=True)


def _line(row) -> str:
    parts = [f"{row['shape']:>11} M={row['M']:<2} N={row['N']:<6} K={row['K']:<6}"]
    if row["floor_ms"]:
        parts.append(f"floor {row['floor_ms'] * 1e3:7.1f} us")
    for key in (*FORMS, "tuned"):
        r = row.get(key)
        if r is None:
            continue
        if "error" in r:
            parts.append(f"{key} ERROR {r['error'][:120]}")
            continue
        ratio = f" {r['x_floor']:.2f}x" if "x_floor" in r else ""
        parts.append(f"{key} {r['ms'] * 1e3:7.1f} us{ratio} (err {r['rel_err']:.1e})")
    return " | ".join(parts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="one tiny shape (smoke test)")
    ap.add_argument("--shapes", nargs="*", help=f"of {sorted(SHAPES)} (default all)")
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--no-tune", dest="tune", action="store_false",
                    help="skip the tuned module (tune fast)")
    a = ap.parse_args(argv)
    shapes = SMALL if a.small else {k: SHAPES[k] for k in (a.shapes or SHAPES)}
    rate = copy_bandwidth(a.device)
    results = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
               "copy_bytes_per_s": rate, "rows": []}
    if rate:
        print(f"copy rate {rate / 1e12:.2f} TB/s", flush=True)
    for name, (N, K) in shapes.items():
        for M in a.tokens:
            run_shape(name, N, K, M, a, rate, results["rows"])
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(results, f, indent=2, default=str)
    return results


if __name__ == "__main__":
    main()
