"""The autotuner survives backend crashes (DESIGN.md failure 5), remembers what failed,
caches what it chose, and never picks a config over the target's limits.

The compile functions in tests/codegen/crashy.py plant aborts, hangs and errors into
chosen configs; they run inside the tuner's workers, as Triton's compiler does. The
worker pool is the process's own, shared by every test (starting one costs seconds).
"""

import math
import types
import warnings

import pytest
import torch

from kiln.codegen.autotune.both_ends import low_sizes, switch_point
from kiln.codegen.autotune.cache import ChoiceCache
from kiln.codegen.autotune.candidates import candidates
from kiln.codegen.autotune.quarantine import FailureKey, Quarantine
from kiln.codegen.autotune.tuner import Tuner, TuningWarning, choose, precompile
from kiln.codegen.autotune.worker_pool import get_pool
from kiln.codegen.build.spec import Config, KernelArg, KernelSpec
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.codegen.expr.values import CodegenUnsupported
from kiln.codegen.size_switch import SizeSwitch
from kiln.codegen.torch_kernel import TorchKernel
from kiln.errors import KilnError
from kiln.ir.plan import DispatchPlan, Op, Ref, Region, RegionKind, Role, TensorValue
from kiln.ir.symbolic import Bounds, numel, symbol
from kiln.pipeline import Context
from kiln.target import get_target

CRASHY = "tests.codegen.crashy:"

ADD_SOURCE = '''import triton
import triton.language as tl


@triton.jit
def add(x_ptr, y_ptr, out_ptr, n, XBLOCK: tl.constexpr):
    offs = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask),
             mask=mask)
'''

TRANSPOSE_SOURCE = '''import triton
import triton.language as tl


@triton.jit
def transpose(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    tile = tl.program_id(0) * BLOCK * BLOCK
    mask = tile + r[:, None] * BLOCK + r[None, :] < n
    x = tl.load(x_ptr + tile + r[:, None] * BLOCK + r[None, :], mask=mask)
    tl.store(out_ptr + tile + r[None, :] * BLOCK + r[:, None], x, mask=mask)
'''


def add_plan() -> tuple[Region, DispatchPlan]:
    """out = x + y over (s0, 3) fp32 tensors: one pointwise region."""
    shape = (symbol("s0"), 3)
    values = {n: TensorValue(n, shape, torch.float32, role)
              for n, role in (("x", Role.INPUT), ("y", Role.INPUT), ("out", Role.OUTPUT))}
    op = Op("out", "aten.add.Tensor", (Ref("x"), Ref("y")), {}, shape, torch.float32)
    region = Region("r0", RegionKind.POINTWISE, [op], ["x", "y"], ["out"])
    return region, DispatchPlan({"s0": Bounds(1, 4096)}, values, [region], ["x", "y"], ["out"])


def add_spec(default: Config, configs: list[Config], names=("x", "y", "out"),
             n=None) -> KernelSpec:
    """out = x + y over n elements (default: the (s0, 3) tensors of add_plan)."""
    x, y, out = names
    return KernelSpec(
        name="add", source=ADD_SOURCE,
        args=[KernelArg("x_ptr", "tensor", x, dtype=torch.float32),
              KernelArg("y_ptr", "tensor", y, dtype=torch.float32),
              KernelArg("out_ptr", "tensor", out, dtype=torch.float32),
              KernelArg("n", "size", expr=symbol("s0") * 3 if n is None else n)],
        tunables=["XBLOCK"], grid=("cdiv(n, XBLOCK)",), configs=configs, default=default,
        template="pointwise")


def transpose_spec(default: Config, configs: list[Config]) -> KernelSpec:
    """Transposes BLOCK x BLOCK tiles: needs BLOCK * BLOCK * 4 bytes of shared memory."""
    return KernelSpec(
        name="transpose", source=TRANSPOSE_SOURCE,
        args=[KernelArg("x_ptr", "tensor", "x", dtype=torch.float32),
              KernelArg("out_ptr", "tensor", "out", dtype=torch.float32),
              KernelArg("n", "size", expr=symbol("s0") * 3)],
        tunables=["BLOCK"], grid=("cdiv(n, BLOCK * BLOCK)",), configs=configs,
        default=default, template="pointwise")


def tune(spec, target="cuda:sm_90", compiler="compile_counting", **options):
    region, plan = add_plan()
    ctx = Context(get_target(target), {"tune_compiler": CRASHY + compiler, **options})
    return choose(region, spec, ctx.target, ctx, plan), region


@pytest.fixture
def compiles(tmp_path, monkeypatch):
    """The configs the planted compile functions were called with, in order."""
    log = tmp_path / "compiles.log"
    monkeypatch.setenv("KILN_TEST_COMPILE_LOG", str(log))
    return lambda: log.read_text().splitlines() if log.exists() else []


def forget_choices():
    """Make the next tuning tune again (the quarantine stays)."""
    ChoiceCache().clear()


W8 = Config.make(8, 1, XBLOCK=64)
W4 = Config.make(4, 1, XBLOCK=1024)
W8_BIG = Config.make(8, 1, XBLOCK=2048)


def test_abort_is_quarantined_and_never_retried(compiles):
    spec = add_spec(W8, [W4, W8_BIG])
    kernel, region = tune(spec, compiler="compile_abort_on_8_warps", tune="full")
    assert isinstance(kernel, TritonKernel) and kernel.config == W4
    assert kernel.binary.asm["cubin"] and kernel.binary.resources.shared == 0
    assert compiles() == [f"add {W8}", f"add {W4}"]
    crash = Quarantine().get(FailureKey.of(spec, W8, get_target("cuda:sm_90")))
    assert crash.kind == "crash" and "SIGABRT" in crash.reason

    forget_choices()  # tune again: the aborting default is skipped, W4 compiles again
    kernel, region = tune(spec, compiler="compile_abort_on_8_warps", tune="full")
    assert kernel.config == W4 and compiles()[2:] == [f"add {W4}"]
    assert "quarantined" in region.notes[-1]

    # Only quarantined candidates left: not even a worker is asked.
    pool = get_pool()
    sent, started = pool.jobs_sent, pool.workers_started
    with pytest.warns(TuningWarning, match="crash"):
        kernel, _ = tune(spec, compiler="compile_abort_on_8_warps", tune="none")
    assert isinstance(kernel, TorchKernel)
    assert (pool.jobs_sent, pool.workers_started) == (sent, started) and len(compiles()) == 3


def test_hang_times_out_and_is_quarantined(compiles):
    spec = add_spec(W8, [W4])
    with pytest.warns(TuningWarning, match="hang"):  # tune=none: the hanging default only
        kernel, _ = tune(spec, compiler="compile_hang_on_8_warps", tune="none",
                         tune_timeout=3)
    assert isinstance(kernel, TorchKernel)
    hang = Quarantine().get(FailureKey.of(spec, W8, get_target("cuda:sm_90")))
    assert hang.kind == "hang" and "3 s" in hang.reason

    kernel, region = tune(spec, compiler="compile_hang_on_8_warps", tune="full")
    assert kernel.config == W4 and compiles() == [f"add {W8}", f"add {W4}"]
    assert "quarantined" in region.notes[-1]


def test_every_config_fails_falls_back_to_extern_with_a_warning(compiles):
    abort, error = Config.make(8, 1, BLOCK=32), Config.make(2, 1, BLOCK=32)
    too_big = Config.make(4, 1, BLOCK=256)  # 256 KiB of shared memory; gfx942 has 64
    spec = transpose_spec(abort, [error, too_big])
    with pytest.warns(TuningWarning) as caught:
        kernel, region = tune(spec, "rocm:gfx942", "compile_abort_8_error_2", tune="full")
    assert isinstance(kernel, TorchKernel)
    message = str(caught[0].message)
    assert f"[{abort}] crash" in message and "SIGABRT" in message
    assert f"[{error}] error" in message and "planted compiler error" in message
    assert f"[{too_big}] over_limit" in message and "262144 B" in message
    assert region.notes[-1].startswith("extern")

    # Crash and over-limit are facts; the ordinary error is retried (and fails again).
    with pytest.warns(TuningWarning, match="planted compiler error"):
        tune(spec, "rocm:gfx942", "compile_abort_8_error_2", tune="full")
    assert compiles()[3:] == [f"transpose {error}"]


def test_no_worker_can_start_fails_the_kernel_not_its_configs(compiles, monkeypatch):
    from kiln.codegen.autotune import worker_pool as workers

    pool = workers.WorkerPool(2)
    monkeypatch.setattr(workers, "_pool", pool)
    monkeypatch.setattr(workers.sys, "executable", "/bin/false")  # every start fails
    spec = add_spec(W4, [W8_BIG])
    with pytest.warns(TuningWarning, match="no_worker: worker exited with status 1"):
        kernel, _ = tune(spec, tune="full")
    assert isinstance(kernel, TorchKernel) and pool.start_error
    assert Quarantine().all() == [] and compiles() == []
    assert pool.workers_started == 2 and pool.jobs_sent == 0  # gave up, no start loop
    assert pool.workers == []


def test_cache_makes_a_second_tuning_do_nothing(compiles):
    spec = add_spec(Config.make(4, 1, XBLOCK=256), [W4, Config.make(4, 1, XBLOCK=128)])
    first, _ = tune(spec, tune="fast")
    pool = get_pool()
    sent, attempts = pool.jobs_sent, len(compiles())
    assert attempts >= 1
    again, region = tune(spec, tune="fast")
    assert (pool.jobs_sent, len(compiles())) == (sent, attempts)
    assert again.config == first.config
    assert again.binary.asm["cubin"] == first.binary.asm["cubin"]
    assert "(cached)" in region.notes[-1]


def test_precompile_builds_every_kernels_candidates_in_one_pool_run(compiles, monkeypatch):
    """A model's kernels are compiled together (the pool busy across kernels); untimed,
    each kernel's first candidate only, and choosing then compiles nothing more."""
    pool = get_pool()
    runs = []
    real_run = pool.run

    def counted(jobs, *a, **k):
        runs.append(sorted(f"{j.spec.name} {j.config}" for j in jobs))
        return real_run(jobs, *a, **k)

    monkeypatch.setattr(pool, "run", counted)
    add = add_spec(W4, [W4, W8])
    tile16 = Config.make(4, 1, BLOCK=16)
    transpose = transpose_spec(tile16, [tile16, Config.make(4, 1, BLOCK=32)])
    region, plan = add_plan()
    ctx = Context(get_target("cuda:sm_90"), {"tune_compiler": CRASHY + "compile_counting"})
    tuner = precompile([(region, add), (region, transpose), (region, add)], ctx.target, ctx,
                       plan)
    assert runs == [sorted([f"add {W4}", f"transpose {tile16}"])]
    kernels = [choose(region, s, ctx.target, ctx, plan, tuner) for s in (add, transpose)]
    assert [k.config for k in kernels] == [W4, tile16]
    assert len(runs) == 1 and sorted(compiles()) == runs[0]


def test_second_compile_of_a_model_tunes_nothing(compiles, monkeypatch):
    import kiln
    from kiln.codegen import select_kernels

    def generate_add(region, plan, target):  # a 1-op generator for same-shape adds
        op = region.ops[0]
        shapes = {plan.values[v].shape for v in region.inputs}
        if len(region.ops) != 1 or op.target != "aten.add.Tensor" or len(shapes) != 1:
            raise CodegenUnsupported("not a same-shape add")
        out = plan.values[region.outputs[0]]
        return add_spec(Config.make(4, 1, XBLOCK=128), [W4],
                        (*region.inputs, region.outputs[0]), numel(out.shape))

    monkeypatch.setitem(select_kernels.TEMPLATES, RegionKind.POINTWISE, generate_add)

    class Add(torch.nn.Module):
        def forward(self, x, y):
            return x + y

    n = torch.export.Dim("n", min=2, max=64)
    x, y = torch.randn(4, 8), torch.randn(4, 8)

    def compile_add():
        return kiln.compile(Add(), (x, y), dynamic_shapes=({0: n}, {0: n}),
                            target="cuda:sm_90",
                            options={"tune_compiler": CRASHY + "compile_counting"})

    assert "r0: triton" in compile_add().describe()
    attempts, sent = len(compiles()), get_pool().jobs_sent
    assert attempts >= 1
    assert "r0: triton" in compile_add().describe()
    assert (len(compiles()), get_pool().jobs_sent) == (attempts, sent)


def test_tune_none_compiles_only_the_default_in_a_worker(compiles):
    default = Config.make(4, 1, XBLOCK=256)
    spec = add_spec(default, [W4, W8_BIG])
    sent = get_pool().jobs_sent
    kernel, _ = tune(spec, tune="none")
    assert kernel.config == default and compiles() == [f"add {default}"]
    assert get_pool().jobs_sent == sent + 1


def test_config_over_shared_memory_limit_is_never_chosen(compiles):
    too_big, fits = Config.make(4, 1, BLOCK=256), Config.make(4, 1, BLOCK=64)
    spec = transpose_spec(too_big, [too_big, fits])
    target = get_target("rocm:gfx942")
    kernel, _ = tune(spec, target.name, tune="full")
    assert kernel.config == fits
    assert kernel.binary.resources.shared <= target.shared_mem_per_block
    record = Quarantine().get(FailureKey.of(spec, too_big, target))
    assert record.kind == "over_limit" and "262144 B" in record.reason


def test_estimated_over_limit_is_not_even_compiled(compiles):
    too_big, fits = Config.make(4, 1, BLOCK=256), Config.make(4, 1, BLOCK=64)
    spec = transpose_spec(too_big, [fits])
    target = get_target("rocm:gfx942")
    region, plan = add_plan()

    def estimate(spec, config, target):
        return types.SimpleNamespace(shared=config["BLOCK"] ** 2 * 4)

    tuner = Tuner(target, "full", CRASHY + "compile_counting", estimator=estimate)
    kernel = tuner.choose(region, spec, plan)
    assert kernel.config == fits and compiles() == [f"transpose {fits}"]
    assert "estimated: needs 262144 B" in region.notes[-1]


def test_interpret_target_runs_the_default_without_tuning():
    spec = add_spec(Config.make(4, 1, XBLOCK=16), [W4])
    sent = get_pool().jobs_sent
    kernel, _ = tune(spec, "interpret")
    assert kernel.interpret and kernel.config == spec.default and get_pool().jobs_sent == sent
    x, y, out = torch.randn(5, 3), torch.randn(5, 3), torch.empty(5, 3)
    kernel.run({"x": x, "y": y}, {"out": out}, {"s0": 5})
    torch.testing.assert_close(out, x + y)


def test_fast_mode_tries_the_default_and_its_neighbours():
    default = Config.make(4, 2, XBLOCK=256)
    near = [Config.make(8, 2, XBLOCK=256), Config.make(4, 2, XBLOCK=512),
            Config.make(4, 3, XBLOCK=256)]
    far = [Config.make(8, 3, XBLOCK=1024), Config.make(2, 1, XBLOCK=64)]
    spec = add_spec(default, [far[0], *near, far[1], default])
    assert candidates(spec, "fast") == [default, *near]
    assert candidates(spec, "full") == [default, far[0], *near, far[1]]
    assert candidates(spec, "none") == [default]
    lonely = add_spec(default, far)  # no neighbours: topped up from the spec's order
    assert candidates(lonely, "fast") == [default, *far]


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend the target's GPU is here; `times[config]` (None: extern) is what bench says."""
    from kiln.codegen.autotune import tuner as tune_module

    times, benched = {}, []

    def bench(kernel, inputs, outs, env):
        config = getattr(kernel, "config", None)
        benched.append(config)
        return times[config]

    def outputs(kernel, inputs, like, env, inplace=None):  # each config's: times["wrong"]
        config = getattr(kernel, "config", None)
        return {"out": torch.full((4,), 2.0 if config in times.get("wrong", ()) else 1.0)}

    monkeypatch.setenv("KILN_TUNE_TIMING", "inprocess")  # bench and outputs run here
    monkeypatch.setattr(tune_module, "gpu_for", lambda target: True)
    monkeypatch.setattr(tune_module, "example_buffers", lambda *a: ({}, {}))
    monkeypatch.setattr(tune_module, "bench", bench)
    monkeypatch.setattr(tune_module, "outputs", outputs)
    return times, benched


def test_timed_tuning_picks_the_fastest_per_size_bucket(fake_gpu, compiles):
    times, benched = fake_gpu
    default, other = Config.make(4, 1, XBLOCK=256), Config.make(4, 1, XBLOCK=512)
    spec = add_spec(default, [other, W8])
    times.update({default: 2.0, other: 1.0, W8: math.inf, None: 3.0})  # W8 fails to run
    kernel, region = tune(spec, tune="full", example_env={"s0": 100})
    assert kernel.config == other and "timed" in region.notes[-1]
    assert sorted(map(str, benched)) == sorted(map(str, [default, other, W8, None]))

    benched.clear()
    times[None] = 0.5  # a new size bucket (s0=100 and 120 share one: 128) is tuned anew
    assert tune(spec, tune="full", example_env={"s0": 120})[0].config == other
    assert benched == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # extern winning a fair race is no failure
        kernel, region = tune(spec, tune="full", example_env={"s0": 1000})
    assert isinstance(kernel, TorchKernel) and "extern is fastest" in region.notes[-1]


def decode_batch_tuning(monkeypatch, fake_gpu, table):
    """Tune add_plan with s0 a decode batch (1..4 rows): `table[config][s0]` is what
    bench says (config None: extern). Returns (kernel, region, benched configs)."""
    times, benched = fake_gpu
    from kiln.codegen.autotune import tuner as tune_module

    def bench(kernel, inputs, outs, env):
        benched.append(getattr(kernel, "config", None))
        return table[getattr(kernel, "config", None)][env["s0"]]

    monkeypatch.setattr(tune_module, "bench", bench)
    spec = add_spec(D256, [D512])
    region, plan = add_plan()
    plan.symbols["s0"] = Bounds(1, 4)
    ctx = Context(get_target("cuda:sm_90"),
                  {"tune_compiler": CRASHY + "compile_counting", "tune": "full",
                   "example_env": {"s0": 2}})
    return choose(region, spec, ctx.target, ctx, plan), region, benched


D256, D512 = Config.make(4, 1, XBLOCK=256), Config.make(4, 1, XBLOCK=512)


def test_a_decode_batch_near_the_fastest_at_both_ends_runs_one_kernel(
        monkeypatch, fake_gpu, compiles):
    """A dim bounded to a few rows (a decode batch, a CUDA graph per size) is timed at
    its top and at 1 row: a candidate within 3% of the fastest at the top and much
    faster at 1 row serves both; no second kernel is kept."""
    kernel, region, _ = decode_batch_tuning(monkeypatch, fake_gpu, {
        D256: {4: 1.02, 1: 1.0}, D512: {4: 1.3, 1: 1.6}, None: {4: 1.0, 1: 1.5}})
    assert isinstance(kernel, TritonKernel) and kernel.config == D256
    assert "at the batch's low end" in region.notes[-1]


@pytest.mark.parametrize("table, low, high, largest_low", [
    # a GEMV-like config wins 1 row by 33%, cuBLAS 4 rows by 17%: the lines cross at
    # 1 + 3 * 0.5 / (0.5 + 0.2) = 3.1 rows
    ({D256: {4: 1.2, 1: 1.0}, D512: {4: 1.3, 1: 1.6}, None: {4: 1.0, 1: 1.5}},
     D256, None, 3),
    # the other way round, and a crossing near the low end: at 1 + 3 * 0.1 / 1.1 rows
    ({D256: {4: 1.5, 1: 1.5}, D512: {4: 1.0, 1: 1.1}, None: {4: 2.0, 1: 1.0}},
     None, D512, 1),
])
def test_a_decode_batch_whose_ends_want_different_kernels_switches_on_its_size(
        monkeypatch, fake_gpu, compiles, table, low, high, largest_low):
    """No candidate within 3% of the fastest at both ends: each end keeps its winner
    (a Triton config or the torch form alike), the low end's up to where their times
    cross, and the cached choice holds both."""
    kernel, region, benched = decode_batch_tuning(monkeypatch, fake_gpu, table)
    assert isinstance(kernel, SizeSwitch) and kernel.low_sizes == {"s0": largest_low}
    for side, want in ((kernel.low, low), (kernel.high, high)):
        assert getattr(side, "config", None) == want
        assert isinstance(side, TorchKernel if want is None else TritonKernel)
    assert kernel.pick({"s0": largest_low}) is kernel.low
    assert kernel.pick({"s0": largest_low + 1}) is kernel.high
    assert f"switch on size: s0 <= {largest_low}" in region.notes[-1]

    benched.clear()
    again, region, _ = decode_batch_tuning(monkeypatch, fake_gpu, table)
    assert benched == [] and "(cached)" in region.notes[-1]
    assert isinstance(again, SizeSwitch) and again.low_sizes == kernel.low_sizes
    assert getattr(again.low, "config", None) == low
    assert getattr(again.high, "config", None) == high
    if low is not None:  # its binary came back from the cache too
        assert again.low.binary.asm["cubin"] == kernel.low.binary.asm["cubin"]


def test_each_end_of_a_switch_checks_its_winners_outputs(monkeypatch, fake_gpu, compiles):
    """The low end's fastest computes garbage: the next fastest there that matches the
    torch form runs at the low end, and the wrong one is quarantined."""
    fake_gpu[0]["wrong"] = {D512}
    kernel, region, _ = decode_batch_tuning(monkeypatch, fake_gpu, {
        D256: {4: 1.5, 1: 1.2}, D512: {4: 1.5, 1: 1.0}, None: {4: 1.0, 1: 2.0}})
    assert isinstance(kernel, SizeSwitch) and kernel.low.config == D256
    assert isinstance(kernel.high, TorchKernel) and kernel.low_sizes == {"s0": 2}
    assert f"runs [{D256}] ([{D512}] wrong: out: relative error" in region.notes[-1]
    failure = Quarantine().get(FailureKey.of(kernel.low.spec, D512, get_target("cuda:sm_90")))
    assert failure is not None and failure.kind == "wrong"


def test_the_switch_point_is_where_the_two_winners_times_cross():
    assert switch_point((1.0, 2.0), (2.0, 1.0)) == 0.5  # as much to lose either way
    assert switch_point((1.0, 1.02), (2.0, 1.0)) is None  # the low winner serves both
    assert switch_point((1.0, 2.0), (1.01, 1.0)) is None  # the top winner serves both
    assert switch_point((1.0, math.inf), (2.0, 1.0)) == 0.0  # never run it untimed
    assert low_sizes({"b": 1, "t": 7}, {"b": 4, "t": 7}, 0.5) == {"b": 2}
    assert low_sizes({"b": 1}, {"b": 64}, 0.0) == {"b": 1}
    assert low_sizes({"b": 1}, {"b": 64}, 1.0) == {"b": 63}  # the top runs its winner


def test_a_fast_candidate_with_wrong_outputs_is_quarantined_and_never_retried(fake_gpu,
                                                                             compiles):
    """A config that runs fast but computes garbage (a miscompile) loses to the next
    fastest that matches the torch form, and is quarantined as wrong."""
    times, _ = fake_gpu
    default, other = Config.make(4, 1, XBLOCK=256), Config.make(4, 1, XBLOCK=512)
    spec = add_spec(default, [other])
    times.update({default: 2.0, other: 1.0, None: 3.0, "wrong": {other}})
    kernel, region = tune(spec, tune="full", example_env={"s0": 100})
    assert kernel.config == default and "wrong: out: relative error" in region.notes[-1]
    failure = Quarantine().get(FailureKey.of(spec, other, get_target("cuda:sm_90")))
    assert failure is not None and failure.kind == "wrong" and failure.never_retried


def test_when_no_candidate_matches_the_inputs_are_blamed_not_the_configs(fake_gpu, compiles):
    times, _ = fake_gpu
    default, other = Config.make(4, 1, XBLOCK=256), Config.make(4, 1, XBLOCK=512)
    spec = add_spec(default, [other])
    times.update({default: 2.0, other: 1.0, None: 3.0, "wrong": {default, other}})
    kernel, region = tune(spec, tune="full", example_env={"s0": 100})
    assert kernel.config == other and "ill-conditioned" in region.notes[-1]
    assert Quarantine().get(FailureKey.of(spec, other, get_target("cuda:sm_90"))) is None


@pytest.fixture
def planted_runs(tmp_path, monkeypatch):
    """Pretend the GPU is here and time in the run worker with crashy.measure_planted:
    set plan[config] (or plan["extern"]) to what its run does; runs() lists them."""
    import json

    from kiln.codegen.autotune import tuner as tune_module

    log, plan = tmp_path / "runs.log", {}
    monkeypatch.setattr(tune_module, "gpu_for", lambda target: True)
    monkeypatch.setenv("KILN_TEST_RUN_LOG", str(log))

    def tune_planted(spec, **options):
        monkeypatch.setenv("KILN_TEST_RUN_PLAN", json.dumps({str(k): v
                                                             for k, v in plan.items()}))
        return tune(spec, "cuda:sm_90", "compile_stand_in", tune="full",
                    example_env={"s0": 100}, tune_runner=CRASHY + "measure_planted",
                    **options)

    def runs():
        return log.read_text().splitlines() if log.exists() else []
    return plan, tune_planted, runs


def test_a_candidate_that_faults_kills_or_hangs_its_run_worker_is_quarantined(
        planted_runs, compiles):
    """Issue 13: a candidate whose run faults (a CUDA error poisons its process's
    context), ends its worker or passes its deadline, while timed or while its outputs
    are checked, is quarantined as runtime_fault; the worker is replaced and the others
    are timed; the fastest are checked (one that mismatches is quarantined as wrong);
    the next tuning neither compiles nor runs the faulty ones."""
    from kiln.codegen.autotune.worker_pool import get_run_pool

    plan, tune_planted, runs = planted_runs
    fault, dies, hangs, check_faults, wrong, ok = (Config.make(4, 1, XBLOCK=2 ** i)
                                                   for i in range(6, 12))
    spec = add_spec(ok, [fault, dies, hangs, check_faults, wrong])
    plan.update({fault: "fault", dies: "exit", hangs: "hang",
                 check_faults: {"ms": 0.4, "check": "fault"},
                 wrong: {"ms": 0.5, "check": "wrong"}, ok: 1.0, "extern": 3.0})
    started = get_run_pool().workers_started
    kernel, region = tune_planted(spec, tune_run_timeout=2)
    assert kernel.config == ok, region.notes[-1]
    assert region.notes[-1].count("runtime_fault") == 4
    target = get_target("cuda:sm_90")
    failed = {c: Quarantine().get(FailureKey.of(spec, c, target)) for c in plan if c != "extern"}
    assert {c: f.kind for c, f in failed.items() if f} == {
        fault: "runtime_fault", dies: "runtime_fault", hangs: "runtime_fault",
        check_faults: "runtime_fault", wrong: "wrong"}
    assert "illegal memory access" in failed[fault].reason
    assert "exited with status 7" in failed[dies].reason
    assert "2 s limit" in failed[hangs].reason
    assert all(f.never_retried for f in failed.values() if f)
    assert get_run_pool().workers_started - started == 5  # the first, one after each fault
    # every run made its inputs from their description, at the timed size (512 rows)
    assert all(line.endswith("x=(512, 3),y=(512, 3)") for line in runs())
    assert [line.split(" ")[:2] for line in runs() if line.startswith("verify")] == [
        ["verify", str(check_faults)], ["verify", str(wrong)], ["verify", str(ok)]]

    forget_choices()
    before = len(compiles()), len(runs())
    kernel, _ = tune_planted(spec)
    assert kernel.config == ok and get_run_pool().workers_started - started == 5
    tried = compiles()[before[0]:] + runs()[before[1]:]
    # compiled, screened, timed on (screen.py), checked; extern (3x slower) screened only
    assert sorted(line.split(" ")[1] for line in tried) == sorted(
        [str(ok)] * 4 + ["extern"])


def test_a_stopped_run_worker_exits_without_the_compile_waiting_for_it(planted_runs,
                                                                       compiles):
    """select_kernels' stop hands the worker its exit and goes on (the exit tears down a
    CUDA context); the worker still ends, and the next tuning starts another."""
    from kiln.codegen.autotune import worker_pool

    plan, tune_planted, _ = planted_runs
    ok = Config.make(4, 1, XBLOCK=256)
    plan.update({ok: 1.0, "extern": 2.0})
    tune_planted(add_spec(ok, []))
    (worker,) = worker_pool.get_run_pool().workers
    worker_pool.stop_run_worker()
    assert worker_pool._run_pool is None
    assert worker.proc.wait(timeout=60) == 0  # it exited on its own, told to


def test_screening_times_on_only_the_candidates_near_the_fastest():
    from kiln.codegen.autotune.screen import REST, SCREEN, screened_times
    from kiln.codegen.autotune.timing import PRUNE_RATIO

    screen = {"best": 1.0, "near": PRUNE_RATIO - 0.1, "far": PRUNE_RATIO + 0.1, "broken": math.inf}
    rest = {"best": 3.0, "near": 1.5}  # the rest's samples shift the median
    asked = []

    def measure(c, budget):
        asked.append((c, budget))
        ms = screen[c] if budget == SCREEN else rest[c]
        return ms, [ms] * (2 if budget == SCREEN else 3)

    times, pruned = screened_times(measure, list(screen))
    assert pruned == {"far"}
    assert times == {"best": 3.0, "near": 1.5, "far": screen["far"], "broken": math.inf}
    assert [a for a in asked if a[1] == REST] == [("best", REST), ("near", REST)]
    # a runner that reports medians only: the rest's median stands
    times, _ = screened_times(lambda c, b: (screen[c] if b == SCREEN else rest[c], None),
                              ["best", "far"])
    assert times == {"best": 3.0, "far": screen["far"]}


def test_bad_tune_timing_setting_is_named(monkeypatch):
    monkeypatch.setenv("KILN_TUNE_TIMING", "sometimes")
    with pytest.raises(KilnError, match="sometimes"):
        tune(add_spec(W4, []), compiler="compile_stand_in", example_env={"s0": 4})


def test_untimed_tuning_starts_no_run_worker(compiles, monkeypatch):
    """Without the target's GPU (compile-only, cpu, interpret) nothing is timed, so no
    run worker starts: isolation costs those targets nothing."""
    from kiln.codegen.autotune import isolated_runs
    from kiln.codegen.autotune import tuner as tune_module

    def no_worker():
        raise AssertionError("a run worker was asked for")
    monkeypatch.setattr(isolated_runs, "get_run_pool", no_worker)
    monkeypatch.setattr(tune_module, "get_run_pool", no_worker)
    kernel, region = tune(add_spec(W4, [W8]), compiler="compile_stand_in", tune="full",
                          example_env={"s0": 100})
    assert kernel.config == W4 and "untimed" in region.notes[-1]
    assert choose(*add_plan()[:1], add_spec(W4, []), get_target("interpret"), None).interpret


def test_run_errors_are_told_from_cuda_faults():
    """A CUDA error ends the run worker's usefulness (its context is lost); any other
    error is the candidate failing to run, and the worker carries on."""
    from kiln.codegen.autotune.run_worker import fault_of

    assert fault_of(ValueError("bad launch argument")) is None
    assert fault_of(torch.OutOfMemoryError("CUDA out of memory")) is None
    for text in ("CUDA error: an illegal memory access was encountered",
                 "CUDA error: misaligned address", "Triton Error [CUDA]: unspecified "
                 "launch failure"):
        assert text.split(": ")[-1] in fault_of(RuntimeError(text))


def test_mismatch_compares_floating_outputs_where_the_reference_is_finite():
    from kiln.codegen.autotune.verify import mismatch

    want = {"o": torch.tensor([1.0, float("inf"), 3.0]), "i": torch.tensor([1, 2])}
    assert mismatch({"o": torch.tensor([1.0, 0.0, 3.0]), "i": torch.tensor([2, 1])},
                    want) is None  # the inf lane and integer outputs are not judged
    assert "relative error" in mismatch({"o": torch.tensor([1.0, 5.0, 0.0]),
                                         "i": torch.tensor([1, 2])}, want)
    assert "non-finite" in mismatch({"o": torch.tensor([float("nan"), 0.0, 3.0]),
                                     "i": torch.tensor([1, 2])}, want)
    half = {"o": torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)}
    assert mismatch({"o": half["o"] * 1.02}, half) is None  # within 16-bit rounding


def test_an_inplace_output_is_checked_over_a_copy_of_the_input_it_writes():
    """A cache write's kernel stores only the rows it writes (its output is the cache
    at run time): the tuner's check runs it, and the torch form, over a copy of the
    cache passed as that output, not over an empty buffer whose other rows are garbage
    (every such kernel was judged wrong, or right by the allocator's luck)."""
    from kiln.codegen.autotune.timing import inplace_inputs
    from kiln.codegen.autotune.verify import mismatch, outputs

    class RowWrite:  # the kernel: row 2 stored in place, nothing else
        def run(self, inputs, outs, env):
            assert outs["o"].data_ptr() == inputs["cache"].data_ptr()
            outs["o"][2] = inputs["rows"][0]

    class Functional:  # the torch form: the whole written cache
        def run(self, inputs, outs, env):
            outs["o"].copy_(inputs["cache"].index_copy(0, torch.tensor([2]), inputs["rows"]))

    cache = torch.full((64, 8), float("nan")).normal_()
    ins = {"cache": cache, "rows": torch.randn(1, 8)}
    kept = cache.clone()
    region = Region("r", RegionKind.COPY, [], ["cache", "rows"], ["o"], inplace={"o": "cache"})
    inplace = inplace_inputs(region)
    assert inplace == {"o": "cache"}
    want = outputs(Functional(), ins, {"o": cache}, {}, inplace)
    got = outputs(RowWrite(), ins, {"o": cache}, {}, inplace)
    assert mismatch(got, want) is None
    assert torch.equal(ins["cache"], kept)  # each run wrote its own copy


def test_an_inplace_output_over_a_state_it_does_not_read_starts_the_same_each_run():
    """A KV cache write of kiln's models writes the cache without reading it (the cache
    is no input of its region): the check starts that output from the same seeded values
    in the torch form's run and the candidate's, so the rows neither writes agree (from
    empty buffers they held whatever the allocator gave each run)."""
    from kiln.codegen.autotune.timing import inplace_inputs
    from kiln.codegen.autotune.verify import mismatch, outputs

    class RowWrite:  # a kernel storing row 2 only
        def run(self, inputs, outs, env):
            outs["o"][2] = inputs["rows"][0]

    class WrongRow:  # one storing row 3
        def run(self, inputs, outs, env):
            outs["o"][3] = inputs["rows"][0]

    like = {"o": torch.empty(64, 8, dtype=torch.bfloat16)}
    ins = {"rows": torch.randn(1, 8, dtype=torch.bfloat16)}
    region = Region("r", RegionKind.COPY, [], ["rows"], ["o"], inplace={"o": "b_cache"})
    inplace = inplace_inputs(region)
    assert inplace == {"o": None}
    want = outputs(RowWrite(), ins, like, {}, inplace)
    assert bool(torch.isfinite(want["o"].float()).all())
    assert mismatch(outputs(RowWrite(), ins, like, {}, inplace), want) is None
    assert "relative error" in mismatch(outputs(WrongRow(), ins, like, {}, inplace), want)


@pytest.mark.parametrize("options,named", [
    ({"tune": "fastest"}, "fastest"),
    ({"tune_compiler": "compile_binary"}, "compile_binary"),
    ({"tune_timeout": -1}, "-1"),
    ({"tune_compiler": "tests.codegen.crashy:no_such_function"}, "no_such_function"),
    ({"tune_compiler": "no_such_module:compile"}, "no_such_module"),
    ({"tune_timing": "gpu"}, "gpu"),
    ({"tune_runner": "no_such_module:measure"}, "no_such_module"),
    ({"tune_run_timeout": -2}, "-2"),
])
def test_bad_tune_options_are_named(options, named):
    spec = add_spec(W4, [])
    region, plan = add_plan()
    ctx = Context(get_target("cuda:sm_90"), options)
    with pytest.raises(KilnError, match=named):
        choose(region, spec, ctx.target, ctx, plan)


@pytest.mark.gpu
def test_gpu_tuning_times_candidates_and_extern():
    region, plan = add_plan()
    spec = add_spec(Config.make(4, 1, XBLOCK=256), [W4, Config.make(8, 1, XBLOCK=2048)])
    target = get_target("cuda")
    ctx = Context(target, {"tune": "full", "example_env": {"s0": 4096}})
    kernel = choose(region, spec, target, ctx, plan)
    assert "timed" in region.notes[-1] and "extern" in region.notes[-1]
    x, y = torch.randn(1000, 3, device="cuda"), torch.randn(1000, 3, device="cuda")
    out = torch.empty_like(x)
    kernel.run({"x": x, "y": y}, {"out": out}, {"s0": 1000})
    torch.testing.assert_close(out, x + y)


FAULTY_ADD_SOURCE = ADD_SOURCE.replace(
    "    mask = offs < n\n",
    "    mask = offs < n\n"
    "    if XBLOCK == 2048:  # planted: x read 4 TiB past its buffer (an illegal address)\n"
    "        x_ptr += 1 << 40\n")


@pytest.mark.gpu
def test_gpu_a_candidate_that_faults_is_quarantined_and_the_compile_goes_on(tmp_path,
                                                                           monkeypatch):
    """Issue 13 on a real GPU: a candidate's illegal address while it is timed poisons
    only the run worker's CUDA context; it is quarantined, the tuning picks among the
    others, and the winner runs correctly in this process."""
    import dataclasses

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))  # a fresh quarantine
    region, plan = add_plan()
    bad = Config.make(4, 1, XBLOCK=2048)
    spec = dataclasses.replace(add_spec(Config.make(4, 1, XBLOCK=256), [bad, W4]),
                               source=FAULTY_ADD_SOURCE)
    target = get_target("cuda")
    ctx = Context(target, {"tune": "full", "example_env": {"s0": 4096}})
    kernel = choose(region, spec, target, ctx, plan)
    failure = Quarantine().get(FailureKey.of(spec, bad, target))
    assert failure is not None and failure.kind == "runtime_fault", region.notes[-1]
    assert "illegal" in failure.reason.lower()
    x, y = torch.randn(1000, 3, device="cuda"), torch.randn(1000, 3, device="cuda")
    out = torch.empty_like(x)
    kernel.run({"x": x, "y": y}, {"out": out}, {"s0": 1000})
    torch.testing.assert_close(out, x + y)


def test_dynamic_dims_are_timed_at_a_typical_prompt_within_their_bounds():
    """A tiny export example must not tune a prefill kernel for 8 rows."""
    from kiln.codegen.autotune.timing import TUNE_SIZE, timing_env

    plan = types.SimpleNamespace(symbols={"seq": Bounds(1, 8192), "batch": Bounds(1, 4),
                                    "fixed": Bounds(3, 3), "open": Bounds(2, None),
                                    "big": Bounds(1, 100_000)})
    env = timing_env(plan, {"seq": 16, "batch": 2, "fixed": 3, "open": 5, "big": 2000})
    assert env == {"seq": TUNE_SIZE, "batch": 4, "fixed": 3, "open": TUNE_SIZE, "big": 2000}


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16,
                                   torch.int32, torch.bool])
def test_timing_inputs_can_be_made_in_every_dtype(dtype):
    """fp8 has no randn (an fp8 GEMM's tuning died making its weight: found on an H100)."""
    from kiln.codegen.autotune.timing import _random

    t = _random((4, 8), dtype, "cpu")
    assert t.dtype == dtype and t.shape == (4, 8)
    if dtype.is_floating_point:
        assert t.float().abs().sum() > 0


def test_timing_fill_gives_integer_inputs_their_value():
    """A template's timing_fill sets an input (decode positions) to a size expression
    at the timed sizes; other integer inputs stay zero."""
    import kiln
    from kiln.codegen.autotune.timing import example_buffers

    class Gather(torch.nn.Module):
        def forward(self, x, pos, idx):
            return x[pos] + x[idx]

    T = torch.export.Dim("T", min=2, max=64)
    exe = kiln.compile(Gather(), (torch.randn(8, 4), torch.tensor([1, 2]), torch.tensor([0, 1])),
                       dynamic_shapes=({0: T}, None, None), target="cpu")
    region = exe.plan.regions[0]
    (sym,) = exe.plan.symbols
    inputs, _ = example_buffers(region, exe.plan, {sym: 9}, "cpu", {"pos": f"{sym} - 1"})
    assert inputs["pos"].tolist() == [8, 8] and inputs["idx"].tolist() == [0, 0]


def test_timing_fill_chooses_distinct_values_per_row():
    """{"choose_from": n}: each row of the input gets distinct values below n (a
    router's expert choices), so a MoE kernel is not timed with every pair on expert 0."""
    import kiln
    from kiln.codegen.autotune.timing import example_buffers

    class Pick(torch.nn.Module):
        def forward(self, x, ids):
            return x[ids]

    T = torch.export.Dim("T", min=2, max=64)
    exe = kiln.compile(Pick(), (torch.randn(8, 4), torch.zeros(5, 3, dtype=torch.long)),
                       dynamic_shapes=({0: T}, None), target="cpu")
    region = exe.plan.regions[0]
    (sym,) = exe.plan.symbols
    inputs, _ = example_buffers(region, exe.plan, {sym: 9}, "cpu",
                                {"ids": {"choose_from": f"{sym} - 1"}})
    ids = inputs["ids"]
    assert ids.shape == (5, 3) and ids.min() >= 0 and ids.max() < 8
    assert all(len(set(row)) == 3 for row in ids.tolist())


def test_timing_fill_shares_rows_evenly_as_offsets():
    """{"even_offsets": n}: cumulative row counts sharing n rows over the experts (a
    grouped GEMM timed with every row in one expert would time one plain GEMM)."""
    import kiln
    from kiln.codegen.autotune.timing import example_buffers

    class Pick(torch.nn.Module):
        def forward(self, x, offs):
            return x[offs]

    T = torch.export.Dim("T", min=2, max=64)
    exe = kiln.compile(Pick(), (torch.randn(8, 4), torch.zeros(5, dtype=torch.int32)),
                       dynamic_shapes=({0: T}, None), target="cpu")
    region = exe.plan.regions[0]
    (sym,) = exe.plan.symbols
    inputs, _ = example_buffers(region, exe.plan, {sym: 12}, "cpu",
                                {"offs": {"even_offsets": f"{sym}"}})
    assert inputs["offs"].tolist() == [2, 4, 7, 9, 12]


def test_a_workers_reason_keeps_a_cuda_errors_cause_and_a_compilers_last_lines():
    """torch's CUDA errors name the cause on their first line and end in three lines of
    advice; a compiler's message ends with the failing line: the one-line reason a
    quarantine records keeps both ends."""
    from kiln.codegen.autotune.compile_worker import _reason

    cuda = RuntimeError(
        "CUDA error: an illegal memory access was encountered\n"
        "CUDA kernel errors might be asynchronously reported at some other API call, so "
        "the stacktrace below might be incorrect.\n"
        "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
        "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")
    assert _reason(cuda).startswith("RuntimeError: CUDA error: an illegal memory access")
    compiler = ValueError("at 12:8:\n    acc += tl.dot(a, b)\n        ^\nshapes are incompatible")
    why = _reason(compiler)
    assert why.startswith("ValueError: at 12:8:") and why.endswith("^ shapes are incompatible")
    assert _reason(KeyError()) == "KeyError" and _reason(ValueError("one")) == "ValueError: one"
