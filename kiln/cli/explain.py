"""`kiln explain MODEL|ARTIFACT`: print the report of kiln.explain."""

from __future__ import annotations

import sys

from kiln.cli.model_spec import compiled_or_loaded


def cmd_explain(args) -> int:
    exe, secs, how = compiled_or_loaded(args)
    print(exe.explain(kernels=args.kernels, timings=args.timings), end="")
    print(f"# {how} in {secs:.2f} s", file=sys.stderr)
    return 0
