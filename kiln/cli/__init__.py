"""The `kiln` command: compile, run, explain, generate (like iree-compile / iree-run-module).

A model is named as `path/to/file.py:factory` (a function returning (model, args),
(model, args, dynamic_shapes) or a dict with keys model, args, kwargs,
dynamic_shapes), as a built-in (`tiny-llama`), or, for run and explain, as a saved
artifact directory. Every KilnError ends the command with `kiln: error: ...` on
stderr and exit status 2, never a traceback. Any other exception is a kiln bug: its
traceback is printed for the report, then `kiln: internal error: ...`, status 3.

One module per command (compile, run, run_llm, generate, explain); args.py holds the
flags, model_spec.py names and loads models, inputs.py draws random arguments, timing.py
times kiln beside eager PyTorch.
"""

from __future__ import annotations

import sys
import traceback
import warnings

from kiln.cli.args import build_parser
from kiln.errors import KilnError, KilnWarning
from kiln.settings import setup_logging


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what spawned ranks rerun
    setup_logging(verbose=args.verbose)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always", KilnWarning)
            warnings.showwarning = _show
            return args.fn(args)
    except KilnError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the last line of defence, not a handler
        traceback.print_exc()
        print(f"kiln: internal error: {type(e).__name__}: {e}\n  hint: this is a kiln bug "
              "(a user's mistake is a `kiln: error`); please report it with the command "
              "and the traceback above", file=sys.stderr)
        return 3


def _show(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as the command's own lines: `kiln: warning: ...`, hints in CLI words."""
    if isinstance(message, KilnWarning):
        text = message.what + (f"\n  hint: {message.cli_hint}" if message.cli_hint else "")
    else:
        text = f"{category.__name__}: {message}"
    print(f"kiln: warning: {text}", file=sys.stderr)
