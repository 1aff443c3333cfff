"""A prompt-length matmul's finalists at TOP_SIZE are timed at the power cap (each after
power_cap.SUSTAIN_MS of its own back-to-back runs, unscreened); the 512- and 128-row
timings are not. A fake GPU, as in test_prompt_top.py."""

from kiln.codegen.autotune import power_cap
from kiln.codegen.autotune import tuner as tune_module
from kiln.codegen.autotune.screen import SCREEN
from kiln.codegen.autotune.timing import BOTTOM_SIZE, TOP_SIZE, TUNE_SIZE
from kiln.codegen.size_switch import SizeSwitch
from kiln.codegen.torch_kernel import TorchKernel
from tests.codegen import test_autotune, test_prompt_top
from tests.codegen.test_autotune import D256, D512

compiles, fake_gpu = test_autotune.compiles, test_autotune.fake_gpu  # its fixtures
SLOW = test_prompt_top.SLOW


def budgets_by_size(monkeypatch) -> list:
    """[(rows, config, budget)] of every timing the tuner asks for."""
    asked = []
    timed = tune_module._InProcessRuns.time

    def time(self, config, binary, budget=None):
        asked.append((self.env["s0"], config, budget))
        return timed(self, config, binary, budget)

    monkeypatch.setattr(tune_module._InProcessRuns, "time", time)
    return asked


def test_the_top_finalists_are_timed_sustained_and_the_rest_as_before(monkeypatch, fake_gpu,
                                                                       compiles):
    asked = budgets_by_size(monkeypatch)
    table = {D256: {128: 0.3, 512: 1.0, 2048: 4.6}, D512: {128: 0.33, 512: 1.1, 2048: 4.8},
             SLOW: {512: 2.0}, None: {128: 0.31, 512: 1.05, 2048: 4.0}}
    kernel, region, _ = test_prompt_top.prompt_tuning(monkeypatch, fake_gpu, table)
    top = [(c, b) for s0, c, b in asked if s0 == TOP_SIZE]
    assert {c for c, _ in top} == {D256, D512, None}  # the finalists and the torch form
    assert all(b == power_cap.SUSTAINED for _, b in top)
    for size in (TUNE_SIZE, BOTTOM_SIZE):
        assert all(b != power_cap.SUSTAINED for s0, _, b in asked if s0 == size)
    assert any(b == SCREEN for s0, _, b in asked if s0 == TUNE_SIZE)  # screened there
    assert f"finalists at s0={TOP_SIZE} ({power_cap.describe()})" in region.notes[-1]
    # the torch form, faster at the cap, runs long prompts
    assert isinstance(kernel, SizeSwitch) and isinstance(kernel.high, TorchKernel)


def test_a_region_too_short_to_heat_the_card_is_timed_at_the_top_the_screened_way(
        monkeypatch, fake_gpu, compiles):
    """Its fastest form under power_cap.MIN_MS at 512 rows: sustaining it would cost
    seconds of host time (do_bench's warm-up counted in runs) for nothing."""
    asked = budgets_by_size(monkeypatch)
    small = power_cap.MIN_MS / 2
    table = {D256: {128: small / 4, 512: small, 2048: 4 * small},
             D512: {128: small / 4, 512: 1.01 * small, 2048: 4.1 * small},
             SLOW: {512: 2 * small}, None: {128: small, 512: 2 * small, 2048: 8 * small}}
    kernel, region, _ = test_prompt_top.prompt_tuning(monkeypatch, fake_gpu, table)
    top = [b for s0, _, b in asked if s0 == TOP_SIZE]
    assert top and power_cap.SUSTAINED not in top and SCREEN in top
    assert power_cap.describe() not in region.notes[-1]
    assert kernel.config == D256


def test_the_choice_cache_key_says_the_top_was_timed_sustained(monkeypatch, fake_gpu,
                                                               compiles):
    """Choices timed at boost clocks (before power_cap.py) are not reused."""
    keys = []
    sizes = tune_module.Tuner._timing_sizes

    def timing_sizes(self, region, plan):
        keys.append(sizes(self, region, plan))
        return keys[-1]

    monkeypatch.setattr(tune_module.Tuner, "_timing_sizes", timing_sizes)
    table = {D256: {128: 0.3, 512: 1.0, 2048: 4.0}, D512: {128: 0.3, 512: 1.01, 2048: 4.1},
             SLOW: {512: 2.0}, None: {128: 0.4, 512: 1.2, 2048: 4.5}}
    test_prompt_top.prompt_tuning(monkeypatch, fake_gpu, table)
    assert any(power_cap.key() in (k or "") for k in keys)


def test_sustained_times_time_every_candidate_once_at_the_sustained_budget():
    calls = []

    def measure(c, budget):
        calls.append((c, budget))
        return {"a": 1.0, "b": 9.0, None: 2.0}[c], None

    times, pruned = power_cap.sustained_times(measure, ["a", "b", None])
    assert times == {"a": 1.0, "b": 9.0, None: 2.0} and pruned == set()
    assert calls == [("a", power_cap.SUSTAINED), ("b", power_cap.SUSTAINED),
                     (None, power_cap.SUSTAINED)]
