"""The pass manager: named stages of passes, verification after every pass, IR dumps.

A pass is a function IR -> IR with a name. A pass may declare invariants it
*establishes*; from then on the verifier checks them after every later pass, so the
pass that breaks one is named in the error (IREE-style). `KILN_DUMP_IR=<dir>` writes
the printed IR after each pass; `compile_to=<stage>` stops after that stage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import KilnError, VerifierError
from kiln.ir.printer import print_ir
from kiln.ir.verify import check_invariant_names, verify
from kiln.progress import phase, progress, recording
from kiln.settings import dump_ir_dir

log = logging.getLogger("kiln.pipeline")

STAGES = ("import", "graph", "parallel", "dispatch", "codegen", "schedule")


@dataclass
class Pass:
    name: str
    fn: Callable[[Any, Context], Any]
    establishes: tuple[str, ...] = ()

    def __post_init__(self):
        # At definition (usually import) time, so a typo'd invariant fails at once.
        check_invariant_names(self.establishes, where=f"pass {self.name}")

    def __call__(self, ir, ctx):
        return self.fn(ir, ctx)


@dataclass
class Stage:
    name: str
    passes: list[Pass]


@dataclass
class Context:
    """What every pass may read: the target, options, and a place for notes.

    `timings`: seconds by phase (kiln.progress.phase), every pass's included."""

    target: Any
    options: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)


def as_pass(fn=None, *, name: str | None = None, establishes: tuple[str, ...] = ()):
    """Decorator: make `fn(ir, ctx) -> ir` a Pass named after its module."""

    def wrap(f):
        return Pass(name or f.__module__.rsplit(".", 1)[-1], f, establishes)

    return wrap(fn) if fn is not None else wrap


class PassManager:
    def __init__(self, stages: list[Stage], dump_dir: str | None = None, verify_ir: bool = True):
        names = [s.name for s in stages]
        unknown = [n for n in names if n not in STAGES]
        if unknown:
            raise ValueError(f"unknown stages {unknown}")
        self.stages = stages
        self.dump_dir = Path(dump_dir) if dump_dir else dump_ir_dir()
        self.verify_ir = verify_ir
        self.invariants: set[str] = set()
        self.stage_ir: dict[str, object] = {}  # each stage's result, by stage name

    def run(self, ir, ctx: Context, compile_to: str | None = None, start: str | None = None,
            tag: str = ""):
        """Run the stages on `ir`, up to `compile_to`'s; from `start`'s on, when given
        (`ir` is then what the stage before it gave: `stage_ir` keeps each stage's).
        `tag` names a second run of the same stages in the progress bar and the dumps'
        file names."""
        if compile_to is not None and compile_to not in STAGES:
            raise KilnError(
                f"unknown stage {compile_to!r} for compile_to",
                hint="choose one of: " + ", ".join(STAGES),
            )
        self._make_dump_dir()
        names = [s.name for s in self.stages]
        stages = self.stages[names.index(start):] if start is not None else self.stages
        total = sum(len(s.passes) for s in stages)
        step = 0
        desc = f"kiln compile ({tag})" if tag else "kiln compile"
        with progress(total=total, desc=desc, unit="pass") as bar, \
                recording(ctx.timings):
            for stage in stages:
                for p in stage.passes:
                    step += 1
                    bar.set_postfix_str(f"{stage.name}/{p.name}")
                    with phase(f"{stage.name}/{p.name}"):
                        ir = p(ir, ctx)
                    self.invariants.update(p.establishes)
                    with phase("verify"):
                        self._check(ir, stage, p)
                    self._dump(ir, step, stage, p, tag)
                    bar.update(1)
                self.stage_ir[stage.name] = ir
                if stage.name == compile_to:
                    break
        log.info("compile phases: %s", ", ".join(
            f"{k} {v:.2f} s" for k, v in sorted(ctx.timings.items(), key=lambda kv: -kv[1])))
        return ir

    def _check(self, ir, stage: Stage, p: Pass) -> None:
        if not self.verify_ir:
            return
        problems = verify(ir, self.invariants)
        if problems:
            raise VerifierError(
                f"IR verification failed after pass {stage.name}/{p.name}: " + problems[0],
                where=f"pass {stage.name}/{p.name}",
                hint="this is a kiln bug; rerun with KILN_DUMP_IR=<dir> and report the dumps. "
                + (f"({len(problems) - 1} more problems)" if len(problems) > 1 else ""),
            )

    def _make_dump_dir(self) -> None:
        """Before the first pass, so a dump path that cannot be a directory fails at once."""
        if self.dump_dir is None:
            return
        try:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            why = "a file is in the way" if isinstance(e, FileExistsError) else e.strerror or e
            raise KilnError(f"cannot write IR dumps to {self.dump_dir}: {why}",
                            where="dump_ir= (kiln compile --dump-ir) or KILN_DUMP_IR",
                            hint="name a directory, or a path where one can be made") from None

    def _dump(self, ir, step: int, stage: Stage, p: Pass, tag: str = "") -> None:
        if self.dump_dir is None:
            return
        tag = f"{tag}-" if tag else ""
        path = self.dump_dir / f"{tag}{step:02d}-{stage.name}-{p.name}.txt"
        with phase("dump"):
            path.write_text(print_ir(ir))
