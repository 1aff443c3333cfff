"""A prompt-length dim of a matmul or attention region: its finalists at 512 rows timed
again at 2048 (timing.top_env) and at 128 (timing.bottom_env), one kernel where one
serves every size, else a switch on the size. A fake GPU (bench returns the table's
times) and planted compiles, as in test_autotune.py."""

import pytest

from kiln.codegen.autotune import host_cost
from kiln.codegen.autotune import tuner as tune_module
from kiln.codegen.autotune.timing import BOTTOM_SIZE, TOP_SIZE, TUNE_SIZE, bottom_env, top_env
from kiln.codegen.autotune.tuner import choose
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.codegen.size_switch import SizeSwitch
from kiln.codegen.torch_kernel import TorchKernel
from kiln.ir.plan import RegionKind
from kiln.ir.symbolic import Bounds
from kiln.pipeline import Context
from kiln.target import get_target
from tests.codegen import test_autotune
from tests.codegen.test_autotune import CRASHY, D256, D512, add_plan, add_spec

compiles, fake_gpu = test_autotune.compiles, test_autotune.fake_gpu  # its fixtures

SLOW = D256.__class__.make(4, 1, XBLOCK=1024)


def prompt_tuning(monkeypatch, fake_gpu, table, kind=RegionKind.MATMUL, host=False):
    """Tune add_plan's region as a `kind` region whose s0 is a prompt's length (up to
    4096, example 16 rows): `table[config][s0]` is what bench says. Returns (kernel,
    region, [(config, s0) benched]). Without `host`, no host cost is added (the
    tables are the scores; host_cost.py's own tests add it)."""
    benched = []
    if not host:
        monkeypatch.setattr(host_cost, "EXTERN_CALL_MS", 0.0)
        monkeypatch.setattr(host_cost, "LAUNCH_MS", 0.0)

    def bench(kernel, inputs, outs, env):
        config = getattr(kernel, "config", None)
        benched.append((config, env["s0"]))
        return table[config][env["s0"]]

    monkeypatch.setattr(tune_module, "bench", bench)
    spec = add_spec(D256, [D512, SLOW])
    region, plan = add_plan()
    region.kind = kind
    ctx = Context(get_target("cuda:sm_90"),
                  {"tune_compiler": CRASHY + "compile_counting", "tune": "full",
                   "example_env": {"s0": 16}})
    return choose(region, spec, ctx.target, ctx, plan), region, benched


def test_finalists_near_the_fastest_at_both_sizes_run_one_kernel(monkeypatch, fake_gpu,
                                                                  compiles):
    """D512, 1% behind D256 at 512 rows and the fastest at 2048, has the best worst case
    and serves both. SLOW (1.5x at 512) is no finalist: never timed at 2048."""
    kernel, region, benched = prompt_tuning(monkeypatch, fake_gpu, {
        D256: {128: 0.3, 512: 1.0, 2048: 4.1}, D512: {128: 0.3, 512: 1.01, 2048: 4.0},
        SLOW: {512: 1.5}, None: {128: 0.4, 512: 1.2, 2048: 4.5}})
    assert isinstance(kernel, TritonKernel) and kernel.config == D512
    for size in (TOP_SIZE, BOTTOM_SIZE):
        assert {c for c, s0 in benched if s0 == size} == {D256, D512, None}
    assert f"finalists at s0={TOP_SIZE}" in region.notes[-1]
    assert f"at s0={BOTTOM_SIZE}" in region.notes[-1]


def test_a_winner_at_512_far_behind_at_128_gives_way_to_one_that_serves_all(
        monkeypatch, fake_gpu, compiles):
    """D256 wins 512 rows by 2% and 2048 by 1% but takes twice D512's time at 128 rows
    (say a tile that cannot split): D512 is within 3% everywhere and runs every size."""
    kernel, region, _ = prompt_tuning(monkeypatch, fake_gpu, {
        D256: {128: 0.6, 512: 1.0, 2048: 4.0}, D512: {128: 0.3, 512: 1.02, 2048: 4.04},
        SLOW: {512: 1.5}, None: {128: 0.5, 512: 1.2, 2048: 4.5}})
    assert isinstance(kernel, TritonKernel) and kernel.config == D512


def test_a_short_prompts_winner_switches_below_512(monkeypatch, fake_gpu, compiles):
    """None serves every size: D512 is best at 128 rows (0.3 against D256's 0.6), as fast
    as D256 at 512 and 25% behind it at 2048: D512 runs prompts up to 511 rows, D256
    from 512 (within 3% of each other there, their lines cross at 512)."""
    table = {D256: {128: 0.6, 512: 1.0, 2048: 4.0}, D512: {128: 0.3, 512: 1.01, 2048: 5.0},
             SLOW: {512: 1.5}, None: {128: 0.5, 512: 1.2, 2048: 4.2}}
    kernel, region, _ = prompt_tuning(monkeypatch, fake_gpu, table)
    assert isinstance(kernel, SizeSwitch)
    assert kernel.low.config == D512 and kernel.high.config == D256
    assert kernel.low_sizes == {"s0": TUNE_SIZE - 1}


def test_a_winner_at_512_far_behind_at_2048_switches_to_the_tops_winner(monkeypatch,
                                                                        fake_gpu, compiles):
    """The tile that wins 512 rows by 5% is 25% behind the torch form at 2048 (none is
    within 3% of the fastest at both): the torch form runs long prompts, the tile the
    rest, switching where their times cross (512 + 1536 * 0.05 / (0.05 + 1.0) = 585
    rows), and the choice is cached."""
    table = {D256: {128: 0.3, 512: 1.0, 2048: 5.0}, D512: {128: 0.33, 512: 1.1, 2048: 4.8},
             SLOW: {512: 2.0}, None: {128: 0.31, 512: 1.05, 2048: 4.0}}
    kernel, region, _ = prompt_tuning(monkeypatch, fake_gpu, table)
    assert isinstance(kernel, SizeSwitch) and kernel.low_sizes == {"s0": 585}
    assert kernel.low.config == D256 and isinstance(kernel.high, TorchKernel)
    assert kernel.pick({"s0": 16}) is kernel.low and kernel.pick({"s0": 2048}) is kernel.high
    assert "switch on size: s0 <= 585" in region.notes[-1]
    again, region, benched = prompt_tuning(monkeypatch, fake_gpu, table)
    assert benched == [] and "(cached)" in region.notes[-1]
    assert isinstance(again, SizeSwitch) and again.low_sizes == {"s0": 585}


def test_when_nothing_runs_at_2048_the_512_timing_decides(monkeypatch, fake_gpu, compiles):
    """Out of memory at the top, say: the candidates' 512-row times choose, as before."""
    inf = float("inf")
    kernel, region, _ = prompt_tuning(monkeypatch, fake_gpu, {
        D256: {128: 0.3, 512: 1.0, 2048: inf}, D512: {128: 0.32, 512: 1.1, 2048: inf},
        SLOW: {512: 2.0}, None: {128: 0.31, 512: 1.05, 2048: inf}})
    assert isinstance(kernel, TritonKernel) and kernel.config == D256


def test_pointwise_regions_are_timed_at_512_rows_only(monkeypatch, fake_gpu, compiles):
    kernel, region, benched = prompt_tuning(monkeypatch, fake_gpu, {
        D256: {512: 1.0}, D512: {512: 1.01}, SLOW: {512: 1.5}, None: {512: 1.2}},
        kind=RegionKind.POINTWISE)
    assert kernel.config == D256 and {s0 for _, s0 in benched} == {TUNE_SIZE}


def test_the_top_is_a_long_prompt_within_the_dims_bounds():
    region, plan = add_plan()
    region.kind = RegionKind.MATMUL

    def top(bounds, at=TUNE_SIZE):
        plan.symbols["s0"] = bounds
        return top_env(region, plan, {"s0": at})

    assert top(Bounds(1, 8192)) == {"s0": TOP_SIZE}
    assert top(Bounds(2, 1000)) == {"s0": 1000}
    assert top(Bounds(2, None)) == {"s0": TOP_SIZE}
    assert top(Bounds(1, 300), at=300) is None  # timed at its top already
    assert top(Bounds(1, 8)) is None  # a decode batch: its two ends (low_env)
    assert top(Bounds(5000, 8192), at=5000) is None  # past TOP_SIZE already
    region.kind = RegionKind.REDUCTION
    assert top(Bounds(1, 8192)) is None


def test_the_bottom_is_a_short_prompt_within_the_dims_bounds():
    region, plan = add_plan()
    region.kind = RegionKind.ATTENTION

    def bottom(bounds, at=TUNE_SIZE):
        plan.symbols["s0"] = bounds
        return bottom_env(region, plan, {"s0": at})

    assert bottom(Bounds(1, 8192)) == {"s0": BOTTOM_SIZE}
    assert bottom(Bounds(300, 8192)) == {"s0": 300}
    assert bottom(Bounds(1, 100), at=100) is None  # timed at its top already
    assert bottom(Bounds(1, 8)) is None  # a decode batch


@pytest.mark.parametrize("kind", [RegionKind.MATMUL, RegionKind.ATTENTION])
def test_the_choice_cache_keys_say_the_top_is_timed(kind, fake_gpu):
    region, plan = add_plan()
    region.kind = kind
    t = tune_module.Tuner(get_target("cuda:sm_90"), "full", example_env={"s0": 16})
    key = t._timing_sizes(region, plan)
    assert f"top s0={TOP_SIZE}" in key and "finalists<" in key
    assert f"bottom s0={BOTTOM_SIZE}" in key
