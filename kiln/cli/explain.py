"""`kiln explain MODEL|ARTIFACT`: print the report of kiln.explain.

With -tp/-pp (or a multi-device artifact) every rank's part is planned (or loaded) in
this process, compile-only: no devices and no other processes are needed, so the plan
of a model too large for this machine can be read here (on the meta device). Each
device's regions, weights, collectives and transfers are printed; --rank R prints
rank R's whole report instead.
"""

from __future__ import annotations

import sys
import time

from kiln.cli.model_spec import compile_model, compiled_or_loaded, is_artifact, load_model_spec
from kiln.cli.ranks import plan_size
from kiln.errors import KilnError


def cmd_explain(args) -> int:
    if is_artifact(args.model):
        from kiln.artifact.ranks import read_parallel_manifest

        ranks = read_parallel_manifest(args.model)
        if ranks is not None:
            return _explain_ranks(args, ranks["tp"], ranks["pp"], _saved_rank)
    tp, pp = plan_size(args)
    if tp * pp > 1:
        return _explain_ranks(args, tp, pp, _compiled_rank)
    if args.rank is not None:
        raise KilnError("--rank picks a rank of a multi-device plan",
                        hint="give -tp T and/or -pp P too")
    exe, secs, how = compiled_or_loaded(args)
    print(exe.explain(kernels=args.kernels, timings=args.timings), end="")
    print(f"# {how} in {secs:.2f} s", file=sys.stderr)
    return 0


def _explain_ranks(args, tp: int, pp: int, part) -> int:
    from kiln.explain import explain_devices

    world = tp * pp
    if args.rank is not None and not 0 <= args.rank < world:
        raise KilnError(f"--rank {args.rank} is outside the {world} ranks of tp={tp} x pp={pp}",
                        hint=f"give a rank from 0 to {world - 1}")
    t0 = time.perf_counter()
    spec = None if is_artifact(args.model) else load_model_spec(args.model)
    ranks = range(world) if args.rank is None else [args.rank]
    modules = [part(args, spec, {"tp": tp, "pp": pp, "rank": r}) for r in ranks]
    if args.rank is not None:
        print(modules[0].explain(kernels=args.kernels), end="")
    else:
        print(explain_devices([(m.program, m.example_sizes, m.parallel) for m in modules]),
              end="")
    how = "loaded" if spec is None else "planned (compile-only)"
    print(f"# {how} {len(modules)} of {world} ranks in {time.perf_counter() - t0:.2f} s",
          file=sys.stderr)
    return 0


def _compiled_rank(args, spec, parallel: dict):
    exe, _ = compile_model(args, spec, parallel=parallel)
    return exe


def _saved_rank(args, spec, parallel: dict):
    from kiln.artifact.load import load
    from kiln.artifact.ranks import rank_dir
    from kiln.compiled_module import CompiledModule
    from kiln.parallel.config import parse_parallel

    art = load(rank_dir(args.model, parallel["rank"]), args.target)
    return CompiledModule(art.program, art.state, example_sizes=art.example_sizes,
                          parallel=parse_parallel(parallel))
