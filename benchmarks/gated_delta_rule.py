"""The gated delta rule on the local GPU: kiln's generated kernel against
flash-linear-attention's chunked kernels, at the seed's shape (issue 14).

Prefill: B = 1, T = 8192, H = HV = 36, K = V = 256, q/k/v bf16 (q and k L2-normalised),
g fp32 (log-sigmoid: negative), beta sigmoid. Timed: kiln.compile of a module calling
kiln.ops.gated_delta_rule (target cuda), fla's `chunk_gated_delta_rule`, and fla's
`chunk_gated_delta_rule_fwd_h` (the sequential state pass) alone; every output
against an fp32 reference (kiln's PyTorch form of the op in fp32), as relative errors.
kiln's first call (compile) is timed with a cold and a warm cache. Decode: one step
(T = 1, B = 1) with a [36, 256, 256] fp32 state in and out, against the byte floor (the
state read and written, the inputs read, the output written, at the device's measured
copy bandwidth).

Each form of kiln's chunked kernel (template gated_delta: STAGED = 1, the staged form;
STAGED = 0, the one-pass form) can be timed beside kiln's own choice (`--form both`,
the default, or `staged` / `one-pass`): the region's kernel is rebuilt at that form's
config (`--staged-config` / `--one-pass-config`, CHUNK:BV:warps:stages) and launched
directly. `--shape qwen3next` is Qwen3-Next's layer (16 key heads, 32 value heads,
K = V = 128, T = 2048; `--qk-dtype float32` as kiln's model feeds q and k).

Usage (GPU): PYTHONPATH=. python benchmarks/gated_delta_rule.py --out $OUT/gdn.json
Smoke test anywhere: PYTHONPATH=. python benchmarks/gated_delta_rule.py --device cpu --small
(the interpret target; fla is skipped without CUDA). flash-linear-attention 0.6.0 is
imported if installed (FLA_FLASH_QLA=0 is set first so it runs its Triton kernels).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import tempfile
import time

os.environ.setdefault("FLA_FLASH_QLA", "0")  # before fla is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from measure import copy_bandwidth, rel_err, sync, timed_ms  # noqa: E402

import kiln  # noqa: E402
from kiln.codegen.build.triton_kernel import TritonKernel  # noqa: E402
from kiln.ops import gated_delta_rule  # noqa: E402

SEED = dict(B=1, T=8192, H=36, HV=36, K=256, V=256)
QWEN3_NEXT = dict(B=1, T=2048, H=16, HV=32, K=128, V=128)
SMALL = dict(B=1, T=37, H=2, HV=4, K=16, V=16)
ONE_PASS = "32:64:4:2"  # the one-pass form's best at the seed's shape before the staged one


class Prefill(torch.nn.Module):
    def forward(self, q, k, v, g, beta):
        return gated_delta_rule(q, k, v, g, beta, output_final_state=True)


class Decode(torch.nn.Module):
    def forward(self, q, k, v, g, beta, state):
        return gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)


def make_inputs(B, T, H, HV, K, V, dtype, device, seed=0, qk_dtype=None):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q = F.normalize(randn(B, T, H, K), dim=-1).to(qk_dtype or dtype)
    k = F.normalize(randn(B, T, H, K), dim=-1).to(qk_dtype or dtype)
    v = randn(B, T, HV, V).to(dtype)
    g = F.logsigmoid(randn(B, T, HV))  # fp32, negative
    beta = randn(B, T, HV).sigmoid().to(dtype)
    return q, k, v, g, beta










def kiln_compile(model, args, target, cache_dir, options):
    """(compiled module, seconds) with KILN_CACHE_DIR = cache_dir for this compile."""
    old = os.environ.get("KILN_CACHE_DIR")
    os.environ["KILN_CACHE_DIR"] = cache_dir
    try:
        t0 = time.perf_counter()
        exe = kiln.compile(model, args, target=target, options=options)
        out = exe(*args)
        sync("cuda" if target == "cuda" else "cpu")
        return exe, time.perf_counter() - t0, out
    finally:
        if old is None:
            os.environ.pop("KILN_CACHE_DIR", None)
        else:
            os.environ["KILN_CACHE_DIR"] = old


def delta_kernel(exe):
    """The kernel kiln chose for the op's region, and a description of it."""
    for r in exe.program.plan.regions:
        if any(op.target == "kiln.gated_delta_rule.default" for op in r.ops):
            k = exe.program.kplan.kernels[r.name]
            what = (f"triton [{k.config}]" if isinstance(k, TritonKernel) else k.kind)
            return k, what, list(r.notes)
    return None, "missing", []


def load_fla():
    """fla's (chunk_gated_delta_rule, fwd_h runner or None, why fwd_h is missing)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # not installed, or it failed to import
        return None, None, f"fla not importable: {type(e).__name__}: {e}"
    try:
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_scaled_dot_kkt import chunk_scaled_dot_kkt_fwd
        from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd
        from fla.ops.utils import chunk_local_cumsum, solve_tril
    except Exception as e:
        return chunk_gated_delta_rule, None, f"fwd_h parts not importable: {e}"

    def call(fn, **kw):
        names = inspect.signature(fn).parameters
        return fn(**{k: v for k, v in kw.items() if k in names})

    def fwd_h_runner(q, k, v, g, beta):
        """fla's preparation (gate cumsum, A, its solve, w and u) done once; returns a
        zero-argument call of chunk_gated_delta_rule_fwd_h alone."""
        gc = call(chunk_local_cumsum, g=g, chunk_size=64)
        A = call(chunk_scaled_dot_kkt_fwd, k=k, beta=beta, g=gc, g_cumsum=gc,
                 output_dtype=torch.float32)
        A = call(solve_tril, A=A, output_dtype=k.dtype)
        w, u = call(recompute_w_u_fwd, k=k, v=v, beta=beta, A=A, g=gc, g_cumsum=gc)
        return lambda: call(chunk_gated_delta_rule_fwd_h, k=k, w=w, u=u, g=gc,
                            output_final_state=True)

    return chunk_gated_delta_rule, fwd_h_runner, ""


def prefill(shape, dtype, device, target, options, results, forms=(), qk_dtype=None):
    q, k, v, g, beta = make_inputs(**shape, dtype=dtype, device=device, qk_dtype=qk_dtype)
    ref_o, ref_s = gated_delta_rule(q.float(), k.float(), v.float(), g, beta.float(),
                                    output_final_state=True)
    args = (q, k, v, g, beta)
    with tempfile.TemporaryDirectory() as cache:
        exe, cold, _ = kiln_compile(Prefill(), args, target, cache, options)
        exe, warm, (o, s) = kiln_compile(Prefill(), args, target, cache, options)
    _, kernel, notes = delta_kernel(exe)
    row = {"name": "kiln", "kernel": kernel, "ms": timed_ms(lambda: exe(*args), device),
           "err_o": rel_err(o, ref_o), "err_state": rel_err(s, ref_s),
           "compile_cold_s": cold, "compile_warm_s": warm, "notes": notes}
    results["prefill"] = [row]
    save(results)  # kiln's numbers survive an fla that takes the process down
    for form, text in forms:
        results["prefill"].append(forced_form(exe, form, text, args, ref_o, ref_s, target))
        save(results)
    fla, fwd_h, why = load_fla() if device == "cuda" else (None, None, "no CUDA")
    results["fla_note"] = why or None
    if fla is not None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            results["fla_version"] = version("fla-core")
        except PackageNotFoundError:
            results["fla_version"] = None
        def run_fla():
            return fla(q, k, v, g, beta, output_final_state=True)

        try:
            fo, fs = run_fla()
            results["prefill"].append({"name": "fla chunk_gated_delta_rule",
                                       "ms": timed_ms(run_fla, device),
                                       "err_o": rel_err(fo, ref_o),
                                       "err_state": rel_err(fs, ref_s)})
            for r in results["prefill"]:
                if r["name"].startswith("kiln"):
                    r["ratio_vs_fla"] = r["ms"] / results["prefill"][-1]["ms"]
        except Exception as e:  # report it beside kiln's numbers rather than lose them
            results["fla_note"] = f"chunk_gated_delta_rule failed: {type(e).__name__}: {e}"
    if fwd_h is not None:
        try:
            results["prefill"].append({"name": "fla chunk_gated_delta_rule_fwd_h alone",
                                       "ms": timed_ms(fwd_h(q, k, v, g, beta), device)})
        except Exception as e:  # its signature moved between fla versions
            results["fla_note"] = f"fwd_h failed: {type(e).__name__}: {e}"


def forced_form(exe, form, text, args, ref_o, ref_s, target):
    """kiln's kernel for the op's region rebuilt at `form`'s config (CHUNK:BV:warps:stages)
    and launched directly on the call's tensors: a row like kiln's."""
    from kiln.codegen.build.compiler import compile_binary
    from kiln.codegen.build.spec import Config
    from kiln.target import get_target

    kernel, _, _ = delta_kernel(exe)
    name = f"kiln {form} form"
    if not isinstance(kernel, TritonKernel) or "STAGED" not in kernel.spec.tunables:
        return {"name": name, "ms": float("nan"), "error": "no chunked Triton kernel"}
    d = kernel.spec.default
    if text is None:  # kiln's own choice when it is this form, else the seed's
        text = (f"{d['CHUNK']}:{d['BV']}:{d.num_warps}:{d.num_stages}"
                if d["STAGED"] == int(form == "staged") else
                "64:64:4:2" if form == "staged" else ONE_PASS)
    chunk, bv, warps, stages = (int(x) for x in text.split(":"))
    config = Config.make(warps, stages, CHUNK=chunk, BV=bv, STAGED=int(form == "staged"))
    row = {"name": name, "kernel": f"triton [{config}]", "in_space": config in
           kernel.spec.configs}
    try:
        if target == "interpret":
            forced = TritonKernel(kernel.region, kernel.spec, config, interpret=True)
        else:
            t0 = time.perf_counter()
            binary = compile_binary(kernel.spec, config, get_target(target))
            row["compile_s"] = time.perf_counter() - t0
            row["registers"], row["spills"] = binary.resources.registers, binary.resources.spills
            row["shared"] = binary.resources.shared
            forced = TritonKernel(kernel.region, kernel.spec, config, binary)
        plan, region = exe.plan, kernel.region
        given = dict(zip(plan.user_inputs, args))
        inputs = {v: given[v] for v in region.inputs}
        outs = {o: torch.empty(tuple(int(d) for d in plan.values[o].shape),
                               dtype=plan.values[o].dtype, device=args[0].device)
                for o in region.outputs}
        forced.run(inputs, outs, {})
        o, s = sorted(outs.values(), key=lambda t: t.shape != ref_o.shape)
        device = "cuda" if target != "interpret" else "cpu"
        row.update(ms=timed_ms(lambda: forced.run(inputs, outs, {}), device),
                   err_o=rel_err(o, ref_o), err_state=rel_err(s, ref_s))
    except Exception as e:  # a form that fails is reported beside the others
        row.update(ms=float("nan"), error=f"{type(e).__name__}: {e}")
    return row


def decode(shape, dtype, device, target, options, results):
    one = dict(shape, T=1)
    q, k, v, g, beta = make_inputs(**one, dtype=dtype, device=device, seed=1)
    state = torch.randn(one["B"], one["HV"], one["K"], one["V"], device=device)
    args = (q, k, v, g, beta, state)
    ref_o, ref_s = gated_delta_rule(q.float(), k.float(), v.float(), g, beta.float(),
                                    initial_state=state, output_final_state=True)
    with tempfile.TemporaryDirectory() as cache:
        exe, cold, (o, s) = kiln_compile(Decode(), args, target, cache, options)
    kernel, what, _ = delta_kernel(exe)
    row = {"name": "kiln decode step", "kernel": what, "compile_cold_s": cold,
           "err_o": rel_err(o, ref_o), "err_state": rel_err(s, ref_s),
           "ms": timed_ms(lambda: exe(*args), device)}
    if device == "cuda":
        try:
            graphed = exe.cuda_graphs()
            graphed(*args)
            row["ms_cuda_graph"] = timed_ms(lambda: graphed(*args), device)
        except Exception as e:
            row["cuda_graph_error"] = f"{type(e).__name__}: {e}"
    if isinstance(kernel, TritonKernel):  # the kernel alone, launched directly
        row["ms_kernel"] = timed_ms(_launcher(exe, kernel, args), device)
    moved = 2 * state.numel() * 4 + sum(x.numel() * x.element_size()
                                        for x in (q, k, v, g, beta, o))
    bw = copy_bandwidth(device)
    row["bytes"] = moved
    if bw is not None:
        row["copy_gbs"] = bw / 1e9
        row["floor_ms"] = moved / bw * 1e3
        best = min(row.get(x, row["ms"]) for x in ("ms", "ms_cuda_graph", "ms_kernel"))
        row["ratio_vs_floor"] = best / row["floor_ms"]
    results["decode"] = row


def _launcher(exe, kernel: TritonKernel, args):
    """A zero-argument launch of the op's kernel on the call's tensors (no runtime)."""
    plan, region = exe.plan, kernel.region
    given = dict(zip(plan.user_inputs, args))
    missing = [v for v in region.inputs if v not in given]
    if missing:  # the region reads intermediates: time through the module instead
        return lambda: exe(*args)
    inputs = {v: given[v] for v in region.inputs}
    outs = {o: torch.empty(tuple(int(d) for d in plan.values[o].shape),
                           dtype=plan.values[o].dtype, device=args[0].device)
            for o in region.outputs}
    return lambda: kernel.run(inputs, outs, {})


_OUT: list[str] = []


def save(results) -> None:
    if _OUT:
        with open(_OUT[0], "w") as f:
            json.dump(results, f, indent=2, default=str)


def table(results) -> str:
    lines = [f"device: {results['device']}  shape: {results['shape']}  dtype: {results['dtype']}"]
    lines.append(f"{'what':42s} {'ms':>9s} {'err o':>9s} {'err S':>9s}  notes")
    for r in results.get("prefill", []):
        extra = []
        if "ratio_vs_fla" in r:
            extra.append(f"kiln/fla {r['ratio_vs_fla']:.2f}x")
        if "compile_cold_s" in r:
            extra.append(f"compile cold {r['compile_cold_s']:.1f}s warm "
                         f"{r['compile_warm_s']:.1f}s; {r['kernel']}")
        elif "kernel" in r:
            extra.append(r["kernel"])
        if r.get("registers") is not None:
            extra.append(f"{r['registers']} registers, {r['spills']} spilled, "
                         f"{r['shared']} B shared")
        if "error" in r:
            extra.append(r["error"])
        lines.append(f"{r['name']:42s} {r['ms']:9.3f} {r.get('err_o', float('nan')):9.2e} "
                     f"{r.get('err_state', float('nan')):9.2e}  {'; '.join(extra)}")
    if results.get("fla_note"):
        lines.append(f"  fla: {results['fla_note']}")
    d = results.get("decode")
    if d:
        extra = [d["kernel"]]
        if "ms_cuda_graph" in d:
            extra.append(f"cuda graph {d['ms_cuda_graph']:.4f} ms")
        if "ms_kernel" in d:
            extra.append(f"kernel alone {d['ms_kernel']:.4f} ms")
        if "cuda_graph_error" in d:
            extra.append(f"cuda graphs failed: {d['cuda_graph_error']}")
        if "floor_ms" in d:
            extra.append(f"floor {d['floor_ms']:.4f} ms ({d['bytes']} B at "
                         f"{d['copy_gbs']:.0f} GB/s): {d['ratio_vs_floor']:.2f}x")
        lines.append(f"{d['name']:42s} {d['ms']:9.4f} {d['err_o']:9.2e} {d['err_state']:9.2e}"
                     f"  {'; '.join(extra)}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="a tiny shape (smoke test)")
    ap.add_argument("--shape", default="seed", choices=["seed", "qwen3next"])
    ap.add_argument("--qk-dtype", choices=["bfloat16", "float16", "float32"],
                    help="q and k's dtype (default --dtype; kiln's Qwen3-Next feeds float32)")
    ap.add_argument("--form", default="both", choices=["auto", "staged", "one-pass", "both"],
                    help="also time these forms of kiln's kernel, forced (auto: kiln's "
                         "choice only)")
    ap.add_argument("--staged-config", help="CHUNK:BV:warps:stages (default: kiln's "
                    "heuristic's staged config)")
    ap.add_argument("--one-pass-config", default=ONE_PASS, help="CHUNK:BV:warps:stages")
    ap.add_argument("--T", type=int, help="sequence length (default: the seed's 8192)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--tune", default=None, choices=["none", "fast", "full"])
    ap.add_argument("--skip-decode", action="store_true")
    a = ap.parse_args()
    shape = dict(SMALL if a.small else QWEN3_NEXT if a.shape == "qwen3next" else SEED)
    if a.T:
        shape["T"] = a.T
    dtype = getattr(torch, a.dtype)
    target = "cuda" if a.device == "cuda" else "interpret"
    options = {"tune": a.tune} if a.tune else {}
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu (interpret target)"
    results = {"device": name, "shape": shape, "dtype": a.dtype, "target": target,
               "torch": torch.__version__}
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        pass
    if a.out:
        _OUT.append(a.out)
    forms = {"both": ["staged", "one-pass"], "auto": []}.get(a.form, [a.form])
    configs = {"staged": a.staged_config, "one-pass": a.one_pass_config}
    if a.small:  # the tiny shape's chunks
        configs = {"staged": "32:16:4:1", "one-pass": "16:16:4:1"}
    qk = getattr(torch, a.qk_dtype) if a.qk_dtype else None
    results["qk_dtype"] = a.qk_dtype or a.dtype
    prefill(shape, dtype, a.device, target, options, results,
            [(f, configs[f]) for f in forms], qk)
    save(results)
    if not a.skip_decode:
        decode(shape, dtype, a.device, target, options, results)
    print(table(results))
    save(results)


if __name__ == "__main__":
    main()
