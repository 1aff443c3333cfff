"""KILN_TUNE_OVERLAP: with a GPU to time on, a kernel is timed as soon as its own
candidates are compiled, while the model's other kernels still compile
(autotune/background_build.py). The GPU is faked (test_autotune's fake_gpu); the
compiles are real worker-pool jobs (planted compile functions, tests/codegen/crashy.py)."""

import threading

import pytest

from kiln.codegen.autotune import worker_pool
from kiln.codegen.autotune.tuner import choose, precompile
from kiln.codegen.build.spec import Config
from kiln.pipeline import Context
from kiln.target import get_target
from tests.codegen import test_autotune
from tests.codegen.test_autotune import CRASHY, add_plan, add_spec, forget_choices, transpose_spec

compiles, fake_gpu = test_autotune.compiles, test_autotune.fake_gpu  # its fixtures

FAST, SLOW = Config.make(4, 1, XBLOCK=256), Config.make(4, 1, XBLOCK=512)
TILE16, TILE32 = Config.make(4, 1, BLOCK=16), Config.make(4, 1, BLOCK=32)


def _kernels(compiler: str, overlap: bool):
    forget_choices()
    region, plan = add_plan()
    ctx = Context(get_target("cuda:sm_90"),
                  {"tune_compiler": CRASHY + compiler, "tune": "full",
                   "example_env": {"s0": 100}, "tune_overlap": overlap})
    specs = [add_spec(FAST, [FAST, SLOW]), transpose_spec(TILE16, [TILE16, TILE32])]
    tuner = precompile([(region, s) for s in specs], ctx.target, ctx, plan)
    return tuner, region, plan, ctx, specs


def test_a_kernel_is_timed_while_another_still_compiles(fake_gpu, compiles, tmp_path,
                                                        monkeypatch):
    times, benched = fake_gpu
    times.update({FAST: 1.0, SLOW: 2.0, TILE16: 2.0, TILE32: 1.0, None: 3.0})
    gate = tmp_path / "gate"
    monkeypatch.setenv("KILN_TEST_COMPILE_GATE", str(gate))
    tuner, region, plan, ctx, (add, transpose) = _kernels("compile_gated", overlap=True)
    # transpose's candidates wait on the gate: add is built, timed and chosen meanwhile
    assert choose(region, add, ctx.target, ctx, plan, tuner).config == FAST
    assert set(benched) == {FAST, SLOW, None}
    assert not [x for x in compiles() if x.startswith("transpose")]  # still at the gate
    gate.touch()
    assert choose(region, transpose, ctx.target, ctx, plan, tuner).config == TILE32
    tuner.finish()
    assert not [t for t in threading.enumerate() if t.name == "kiln-background-build"]
    assert sorted(compiles()) == sorted(f"{s.name} {c}" for s, cs in
                                        ((add, (FAST, SLOW)), (transpose, (TILE16, TILE32)))
                                        for c in cs)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_choice_and_the_quarantine_do_not_depend_on_the_overlap(fake_gpu, compiles,
                                                                    overlap):
    """8 warps abort in the compiler: quarantined and never chosen, built in the
    background or not."""
    times, _ = fake_gpu
    w8 = Config.make(8, 1, XBLOCK=128)
    times.update({FAST: 2.0, w8: 0.5, None: 3.0, TILE16: 1.0, TILE32: 2.0})
    forget_choices()
    region, plan = add_plan()
    ctx = Context(get_target("cuda:sm_90"),
                  {"tune_compiler": CRASHY + "compile_abort_on_8_warps", "tune": "full",
                   "example_env": {"s0": 100}, "tune_overlap": overlap})
    add = add_spec(FAST, [FAST, w8], names=("x", "y", "out"))
    tuner = precompile([(region, add)], ctx.target, ctx, plan)
    kernel = choose(region, add, ctx.target, ctx, plan, tuner)
    tuner.finish()
    assert kernel.config == FAST
    assert "abort" in region.notes[-1] or "crash" in region.notes[-1]


def test_a_background_build_that_fails_raises_in_the_compile(fake_gpu, compiles,
                                                             monkeypatch):
    times, _ = fake_gpu
    times.update({FAST: 1.0, SLOW: 2.0, None: 3.0})
    pool = worker_pool.get_pool()

    def broken(jobs, *a, **k):
        raise RuntimeError("the pool broke")
        yield  # a generator, as the pool's run is

    monkeypatch.setattr(pool, "run", broken)
    tuner, region, plan, ctx, (add, _) = _kernels("compile_stand_in", overlap=True)
    with pytest.raises(RuntimeError, match="the pool broke"):
        choose(region, add, ctx.target, ctx, plan, tuner)


def test_a_compile_ends_its_background_build_with_the_plan(fake_gpu, compiles, monkeypatch):
    """kiln.compile with the overlap on: the regions' choices are those made without it,
    and no build thread outlives the compile (the pool is the process's: a second
    compile must find it free)."""
    import torch

    import kiln
    from kiln.codegen import select_kernels
    from kiln.ir.plan import RegionKind
    from kiln.ir.symbolic import numel

    times, _ = fake_gpu
    times.update({FAST: 1.0, SLOW: 2.0, None: 3.0})

    def generate_add(region, plan, target):  # the same-shape adds of the model below
        out = plan.values[region.outputs[0]]
        return add_spec(FAST, [FAST, SLOW], (*region.inputs, region.outputs[0]),
                        numel(out.shape))

    monkeypatch.setitem(select_kernels.TEMPLATES, RegionKind.POINTWISE, generate_add)

    class Adds(torch.nn.Module):
        def forward(self, x, y):
            return x + y, (x + y) + x

    from kiln.codegen.autotune import tuner as tune_module

    started = []
    real = tune_module.BackgroundBuild

    def counted(*a, **k):
        started.append(1)
        return real(*a, **k)

    monkeypatch.setattr(tune_module, "BackgroundBuild", counted)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    notes = {}
    for overlap in (False, True):
        forget_choices()
        monkeypatch.setenv("KILN_TUNE_OVERLAP", str(int(overlap)))
        exe = kiln.compile(Adds(), (x, y), target="cuda:sm_90",
                           options={"tune_compiler": CRASHY + "compile_stand_in",
                                    "tune": "full", "compile_cache": False})
        assert not [t for t in threading.enumerate() if t.name == "kiln-background-build"]
        assert len(started) == int(overlap)  # built in the background only when asked
        notes[overlap] = [n for r in exe.program.kplan.plan.regions for n in r.notes
                          if n.startswith("tuned")]
    assert notes[True] == notes[False] and notes[True]
