"""`kiln run MODEL|ARTIFACT`: run a compiled module, summarise its outputs, time it.

An artifact runs on random inputs matching its signature; a model runs on its
example args, or on random inputs with --size, and eager PyTorch runs the same calls:
outputs compared, times side by side. The built-in LLMs generate instead
(kiln.cli.run_llm). With -tp/-pp (or a multi-device artifact) every rank runs the same
calls and rank 0 reports (kiln.cli.ranks starts the ranks outside torchrun).
"""

from __future__ import annotations

import copy

import torch
import torch.utils._pytree as pytree

from kiln.cli.model_spec import compile_model, is_artifact, load_artifact, load_model_spec
from kiln.cli.ranks import plan_size, run_as_ranks
from kiln.cli.timing import side_by_side, timed_calls, to_device
from kiln.errors import KilnError


def cmd_run(args) -> int:
    """Run as every rank of a multi-device plan (-tp/-pp, or a multi-device artifact's):
    kiln starts the other ranks unless this is one of torchrun's processes."""
    tp, pp = plan_size(args)
    if is_artifact(args.model):
        from kiln.artifact.ranks import read_parallel_manifest

        ranks = read_parallel_manifest(args.model)
        saved = (ranks["tp"], ranks["pp"]) if ranks is not None else (1, 1)
        if (tp, pp) not in ((1, 1), saved):
            raise KilnError(f"{args.model} was compiled for tp={saved[0]} x pp={saved[1]}, "
                            f"not tp={tp} x pp={pp}",
                            hint="drop -tp/-pp (an artifact runs as it was compiled), or "
                            "compile the model again with them")
        tp, pp = saved
    args.parallel = {"tp": tp, "pp": pp} if tp * pp > 1 else None
    return run_as_ranks(_run, args, tp * pp)


def _run(args) -> int:
    from kiln.cli.run_llm import is_llm, run_llm
    from kiln.models import BUILTINS

    if args.parallel:
        tp, pp = args.parallel["tp"], args.parallel["pp"]
        print(f"{tp * pp} ranks (tp={tp} x pp={pp}) make every call; rank 0 reports")
    if is_artifact(args.model):
        exe, secs = load_artifact(args)
        print(f"loaded {args.model} ({exe.target}, {len(exe.plan.regions)} regions) "
              f"in {secs:.2f} s")
        call_args, call_kwargs = _random_call(exe, args)
        return _time_and_report(exe, call_args, call_kwargs, args, reference=None)
    spec = load_model_spec(args.model)
    if args.model in BUILTINS and is_llm(spec.model) and not args.size:
        return run_llm(args, spec)
    eager = copy.deepcopy(spec.model)  # the compiled module shares (and updates) its buffers
    exe, secs = compile_model(args, spec, parallel=args.parallel)
    print(f"compiled {args.model} for {exe.target} in {secs:.2f} s: "
          f"{len(exe.plan.regions)} regions")
    if args.size:
        call_args, call_kwargs = _random_call(exe, args)
    else:
        call_args, call_kwargs = spec.args, spec.kwargs
        print("inputs: the factory's example args")
    return _time_and_report(exe, call_args, call_kwargs, args, reference=eager)


def _random_call(exe, args):
    from kiln.cli.inputs import random_inputs, sizes_for

    env = sizes_for(exe, dict(args.size or []))
    named = exe.plan.dim_names
    if env:
        print("sizes: " + ", ".join(f"{named.get(s, s)}={v}" for s, v in sorted(env.items())))
    print(f"inputs: random (seed {args.seed})")
    return random_inputs(exe, env, args.seed)


def _time_and_report(exe, call_args, call_kwargs, args, reference) -> int:
    """Call `exe` 1 + --repeat times, and the eager model (if any) as often on the same
    inputs; summarise the first call's outputs (vs eager's) and both times."""
    device = exe.program.device
    n = 1 + max(args.repeat, 0)
    first, times = timed_calls(lambda: exe(*call_args, **call_kwargs), n, device)
    ref, eager_times = None, None
    if reference is not None:
        eager = reference.to(device) if device.type != "cpu" else reference
        e_args, e_kwargs = to_device((call_args, call_kwargs), device)
        ref, eager_times = timed_calls(lambda: eager(*e_args, **e_kwargs), n, device)
    _print_outputs(first, ref)
    print(side_by_side(times, eager_times))
    return 0


def _print_outputs(out, ref) -> None:
    leaves, _ = pytree.tree_flatten_with_path(out)
    refs = pytree.tree_leaves(ref) if ref is not None else [None] * len(leaves)
    for (path, o), r in zip(leaves, refs):
        name = "output" + pytree.keystr(path)
        if not isinstance(o, torch.Tensor):
            print(f"{name}: {o!r}")
            continue
        line = f"{name}: {_summary(o)}"
        if isinstance(r, torch.Tensor) and o.is_floating_point():
            err = ((o.double() - r.double()).norm() / r.double().norm().clamp_min(1e-30)).item()
            line += f"   rel err vs eager {err:.2e}"
        elif isinstance(r, torch.Tensor):
            same = torch.equal(o.cpu(), r.cpu())
            line += "   equal to eager" if same else "   DIFFERS from eager"
        print(line)


def _summary(t: torch.Tensor) -> str:
    from kiln.ir.printer import type_str

    head = type_str(list(t.shape), t.dtype)
    if t.numel() == 0:
        return head + " (empty)"
    x = t.detach().double()
    finite = x[torch.isfinite(x)]
    bad = x.numel() - finite.numel()
    if finite.numel() == 0:
        return f"{head}  (no finite values)"
    std = finite.std().item() if finite.numel() > 1 else 0.0
    stats = (f"mean {finite.mean().item():.4g}  std {std:.4g}  min {finite.min().item():.4g}  "
             f"max {finite.max().item():.4g}")
    return f"{head}  {stats}" + (f"  ({bad} not finite)" if bad else "")
