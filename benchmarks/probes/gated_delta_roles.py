"""Where the staged gated delta kernel's time goes, role by role, on a GPU (issue 14).

The launch's roles (preparers, walkers, output programs; gated_delta/launch.py) are told
apart by tickets from a counter, so each role can be timed alone by setting the counters
before a launch of just its programs: walkers start at ticket n_prep with every chunk
counted prepared (over the scratch a full launch left), output programs at ticket
n_prep + n_walk with every walker flag past the last chunk. Each role is timed in the
whole kernel (the register allocation every role shares) and compiled alone
(gated_delta_resources.only: its own allocation), so the probe says how much of the
walk is the walk and how much the allocation the preparers impose. fla's fwd_h (the
walk alone, its own kernel) runs in the same process when fla is importable.

Usage: PYTHONPATH=.:<fla site> python benchmarks/probes/gated_delta_roles.py \\
           [--T 8192] [--configs 64:64:4:1,64:32:4:2] [--out roles.json]
(CHUNK:BV:warps:stages, the staged form)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after PYTHONPATH: a tree to compare
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("FLA_FLASH_QLA", "0")

import kiln  # noqa: E402
from benchmarks.gated_delta_rule import load_fla, make_inputs  # noqa: E402
from benchmarks.probes.gated_delta_resources import only  # noqa: E402
from kiln.codegen.build.compiler import load_kernel  # noqa: E402
from kiln.codegen.build.spec import Config  # noqa: E402
from kiln.codegen.build.triton_kernel import TritonKernel  # noqa: E402
from kiln.ops import gated_delta_rule  # noqa: E402


class Prefill(torch.nn.Module):
    def forward(self, q, k, v, g, beta):
        return gated_delta_rule(q, k, v, g, beta, output_final_state=True)


def timed(fn, reset, reps=30):
    """Median ms of fn() with reset() before each call, minus reset()'s own time."""
    def run(f):
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            reset()
            a.record()
            f()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        return sorted(ts)[len(ts) // 2]
    for _ in range(3):
        reset()
        fn()
    torch.cuda.synchronize()
    return run(fn)


_BARRIER = "tl.debug_barrier()  # the CTA's stores of this chunk land before the count"
_COUNT = re.compile(r'tl.atomic_add\((gd_flag .+?), 1, sem="release"\)')
_WAIT = re.compile(r"while tl.load\((gd_flag .+?), volatile=True\) <= jj:")


def thread_release(source: str, threads: int) -> str:
    """The walker's chunk count as one release per thread (each orders its own stores)
    instead of a CTA barrier and one release: Triton 3.6 pipelines no load of a loop
    that holds a barrier. Output programs then wait for threads x (chunk + 1)."""
    assert _BARRIER in source
    source = source.replace(_BARRIER, "pass")
    source, n = _COUNT.subn(rf'tl.atomic_add(\1 + tl.zeros([{threads}], tl.int32), 1, '
                            r'sem="release")', source)
    assert n == 1
    source, n = _WAIT.subn(rf"while tl.load(\1, volatile=True) < (jj + 1) * {threads}:",
                           source)
    assert n == 1
    return source


def roles_at(spec, inputs, outs, shape, c, bv, w, st, variant="", ref=None):
    """One staged config's row: the whole launch, then each role in it and alone."""
    scale = 1
    if variant == "thread-release":
        spec, scale = dataclasses.replace(spec, source=thread_release(spec.source, 32 * w)), 32 * w
    cfg = Config.make(w, st, CHUNK=c, BV=bv, STAGED=1)
    tk = TritonKernel.__new__(TritonKernel)
    tk.spec, tk.config = spec, cfg
    tk._tunables = [cfg[t] for t in spec.tunables]
    largs, _ = tk.launch_args(inputs, outs, {})
    first = len(largs) - len(spec.tunables) - len(spec.scratch)
    scratch = {b.name: largs[first + i] for i, b in enumerate(spec.scratch)}
    ctr, flags = scratch["gd_ctr"], scratch["gd_flag"]
    nh, nj, nvb = shape["HV"], -(-shape["T"] // c), -(-shape["V"] // bv)
    n_prep, n_walk = nh * nj, nh * nvb
    n_out = n_prep * nvb
    whole = load_kernel(spec.source, spec.name)
    alone = {r: load_kernel(only(spec.source, r), spec.name)
             for r in ("preparers", "walkers", "outputs")}

    def launch(fn, n):
        return fn[(n,)](*largs, num_warps=w, num_stages=st)

    def counters(tickets, prepared, flag):
        def reset():
            ctr[0], ctr[1], ctr[2] = tickets, prepared, 0
            flags.fill_(flag)
        return reset

    full = counters(0, 0, 0)
    full()
    ck = launch(whole, n_prep + n_walk + n_out)  # fills the scratch the roles read
    torch.cuda.synchronize()
    errs = {}
    if ref is not None:
        for t in outs.values():  # o and the final state, told apart by shape
            r = next(r for r in ref if r.shape == t.shape)
            errs[f"rel err {tuple(t.shape)}"] = ((t.float() - r).norm() / r.norm()).item()
    row = {"config": str(cfg), "variant": variant, **errs, "regs": getattr(ck, "n_regs", None),
           "spills": getattr(ck, "n_spills", None),
           "whole": timed(lambda: launch(whole, n_prep + n_walk + n_out), full)}
    roles = (("preparers", n_prep, full),
             ("walkers", n_walk, counters(n_prep, n_prep, 0)),  # walkers overwrite gd_u
             ("outputs", n_out, counters(n_prep + n_walk, n_prep, nj * scale)))
    for role, n, reset in roles:
        row[f"{role} in whole"] = timed(lambda n=n: launch(whole, n), reset)
        reset()
        made = launch(alone[role], n)
        torch.cuda.synchronize()
        row[f"{role} alone regs, spills"] = [getattr(made, "n_regs", None),
                                             getattr(made, "n_spills", None)]
        row[f"{role} alone"] = timed(lambda n=n, r=role: launch(alone[r], n), reset)
    row["walk us a chunk (in whole)"] = 1000 * row["walkers in whole"] / nj
    row["walk us a chunk (alone)"] = 1000 * row["walkers alone"] / nj
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--configs", default="64:64:4:1,64:32:4:1,64:32:4:2,64:32:8:2")
    ap.add_argument("--variants", default="base", help="base,thread-release")
    ap.add_argument("--out")
    a = ap.parse_args()
    shape = dict(B=1, T=a.T, H=36, HV=36, K=256, V=256)
    args = make_inputs(**shape, dtype=torch.bfloat16, device="cuda")
    exe = kiln.compile(Prefill(), args, target="cuda", options={"tune": "none"})
    (kernel,) = [x for x in exe.program.kplan.kernels.values()
                 if isinstance(x, TritonKernel) and x.spec.template == "gated_delta"]
    region, plan = kernel.region, exe.plan
    given = dict(zip(plan.user_inputs, args))
    inputs = {n: given[n] for n in region.inputs}
    outs = {o: torch.empty(tuple(int(d) for d in plan.values[o].shape),
                           dtype=plan.values[o].dtype, device="cuda") for o in region.outputs}
    q, k, v, g, beta = args
    ref = [x.float() for x in gated_delta_rule(q.float(), k.float(), v.float(), g, beta.float(),
                                                output_final_state=True)]
    rows = []
    fla, fwd_h, why = load_fla()
    if fla is not None:
        q, k, v, g, beta = args
        none = lambda: None  # noqa: E731
        rows.append({"what": "fla chunk_gated_delta_rule",
                     "ms": timed(lambda: fla(q, k, v, g, beta, output_final_state=True), none)})
        if fwd_h is not None:
            rows.append({"what": "fla fwd_h alone", "ms": timed(fwd_h(q, k, v, g, beta), none)})
    else:
        rows.append({"what": "fla", "note": why})
    print(json.dumps(rows[-1]), flush=True)
    for text in a.configs.split(","):
        c, bv, w, st = (int(x) for x in text.split(":"))
        for variant in a.variants.split(","):
            rows.append(roles_at(kernel.spec, inputs, outs, shape, c, bv, w, st,
                                 "" if variant == "base" else variant, ref))
            print(json.dumps(rows[-1]), flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(rows, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
