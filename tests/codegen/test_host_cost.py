"""Host cost in the tuner's scores (autotune/host_cost.py): a region with a prompt-length
dim runs without CUDA graphs, so each candidate's launch costs host time beside its GPU
time, and the extern form's ATen calls cost more than a kiln launch. A fake GPU and
planted compiles, as in test_prompt_top.py."""

import torch

from kiln.codegen.autotune import host_cost
from kiln.codegen.autotune import tuner as tune_module
from kiln.codegen.autotune.host_cost import extern_calls, host_exposed, with_host_cost
from kiln.codegen.autotune.tuner import choose
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.codegen.size_switch import SizeSwitch
from kiln.codegen.torch_kernel import TorchKernel
from kiln.ir.plan import Op, Ref, Region, RegionKind
from kiln.ir.symbolic import Bounds, symbol
from kiln.pipeline import Context
from kiln.target import get_target
from tests.codegen import test_autotune
from tests.codegen.test_autotune import CRASHY, D256, D512, add_plan, add_spec
from tests.codegen.test_prompt_top import SLOW

compiles, fake_gpu = test_autotune.compiles, test_autotune.fake_gpu  # its fixtures


PROMPT = Bounds(1, 4096)


def tuned(monkeypatch, table, bounds=PROMPT, example=16, kind=RegionKind.POINTWISE):
    """add_plan's region (s0 in `bounds`) tuned on a fake GPU whose bench says
    `table[config][s0]`, host cost as host_cost.py sets it. Returns (kernel, region)."""
    def bench(kernel, inputs, outs, env):
        return table[getattr(kernel, "config", None)][env["s0"]]

    monkeypatch.setattr(tune_module, "bench", bench)
    region, plan = add_plan()
    region.kind = kind
    plan.symbols["s0"] = bounds
    ctx = Context(get_target("cuda:sm_90"),
                  {"tune_compiler": CRASHY + "compile_counting", "tune": "full",
                   "example_env": {"s0": example}})
    spec = add_spec(D256, [D512, SLOW])
    return choose(region, spec, ctx.target, ctx, plan), region


def test_a_near_tie_in_a_prompt_module_goes_to_the_kiln_kernel(monkeypatch, fake_gpu,
                                                                compiles):
    """The extern form is 10% faster on the GPU, but its ATen call's host time is more
    than a launch's by more than that: the kiln kernel wins, and the note says why."""
    kernel, region = tuned(monkeypatch, {D256: {512: 0.020}, D512: {512: 0.022},
                                         SLOW: {512: 0.05}, None: {512: 0.018}})
    assert isinstance(kernel, TritonKernel) and kernel.config == D256
    assert "host cost added" in region.notes[-1], region.notes[-1]


def test_a_clear_extern_win_stands(monkeypatch, fake_gpu, compiles):
    kernel, _ = tuned(monkeypatch, {D256: {512: 0.6}, D512: {512: 0.65},
                                    SLOW: {512: 0.9}, None: {512: 0.5}})
    assert isinstance(kernel, TorchKernel)


def test_a_decode_batch_is_scored_on_gpu_time_alone(monkeypatch, fake_gpu, compiles):
    """A dim bounded by 8 is a decode batch (every size a CUDA graph): no host cost, so
    the same 10% extern lead wins at both ends."""
    table = {c: {1: t, 8: t} for c, t in ((D256, 0.020), (D512, 0.022), (SLOW, 0.05),
                                         (None, 0.018))}
    kernel, region = tuned(monkeypatch, table, bounds=Bounds(1, 8), example=8)
    assert isinstance(kernel, TorchKernel)
    assert "host cost" not in region.notes[-1]


def test_exposure_and_calls():
    region, plan = add_plan()
    assert host_exposed(region, plan)  # s0 in [1, 4096]
    plan.symbols["s0"] = Bounds(1, 64)
    assert not host_exposed(region, plan)
    plan.symbols["s0"] = Bounds(7, 7)
    assert not host_exposed(region, plan)
    s0 = symbol("s0")
    ops = [Op("w_t", "aten.permute.default", (Ref("w"), [1, 0]), {}, (4, 3), torch.float32),
           Op("x2", "aten.view.default", (Ref("x"), [s0, 3]), {}, (s0, 3), torch.float32),
           Op("mm", "aten.mm.default", (Ref("x2"), Ref("w_t")), {}, (s0, 4), torch.float32),
           Op("out", "aten.add.Tensor", (Ref("mm"), Ref("b")), {}, (s0, 4), torch.float32)]
    matmul = Region("r1", RegionKind.MATMUL, ops, ["x", "w", "b"], ["out"])
    assert extern_calls(matmul) == 2  # mm and add; the views are kept from call to call
    scored = with_host_cost({D256: 0.1, None: 0.1}, matmul)
    assert scored[D256] == 0.1 + host_cost.LAUNCH_MS
    assert scored[None] == 0.1 + 2 * host_cost.EXTERN_CALL_MS


def test_a_prompt_matmul_adds_host_cost_at_128_rows_only(monkeypatch, fake_gpu, compiles):
    """A matmul's prompt dim is timed at 512, 2048 and 128 rows: the extern form leads by
    5% at 512 and 2048 (GPU-bound sizes: no host cost there) and by 10% of GPU time at
    128, where its ATen call's host time makes it the slower: short prompts run the kiln
    kernel, long ones the extern form."""
    from tests.codegen.test_prompt_top import prompt_tuning

    table = {D256: {128: 0.020, 512: 1.05, 2048: 4.2}, D512: {128: 0.022, 512: 1.1, 2048: 4.4},
             SLOW: {512: 2.0}, None: {128: 0.018, 512: 1.0, 2048: 4.0}}
    kernel, region, _ = prompt_tuning(monkeypatch, fake_gpu, table, host=True)
    assert isinstance(kernel, SizeSwitch), region.notes[-1]
    assert isinstance(kernel.low, TritonKernel) and kernel.low.config == D256
    assert isinstance(kernel.high, TorchKernel)
    assert "host cost added" in region.notes[-1]


def test_a_batched_prompt_scores_both_batch_ends_with_host_cost(monkeypatch, fake_gpu,
                                                                compiles):
    """A batched prefill: s0 a decode-sized batch (both ends timed) and s1 a prompt length.
    Both ends are scored with host cost, so the extern form's 10% GPU lead loses at both
    and one kiln kernel serves them (no switch from scoring the ends differently)."""
    from kiln.ir.plan import DispatchPlan, Role, TensorValue

    s0, s1 = symbol("s0"), symbol("s1")
    shape = (s0, s1)
    values = {n: TensorValue(n, shape, torch.float32, role)
              for n, role in (("x", Role.INPUT), ("y", Role.INPUT), ("out", Role.OUTPUT))}
    op = Op("out", "aten.add.Tensor", (Ref("x"), Ref("y")), {}, shape, torch.float32)
    region = Region("r0", RegionKind.POINTWISE, [op], ["x", "y"], ["out"])
    plan = DispatchPlan({"s0": Bounds(1, 8), "s1": Bounds(1, 4096)}, values, [region],
                        ["x", "y"], ["out"])
    gpu = {D256: 0.020, D512: 0.022, SLOW: 0.05, None: 0.018}
    benched = []

    def bench(kernel, inputs, outs, env):
        config = getattr(kernel, "config", None)
        benched.append(env["s0"])
        return gpu[config]  # a small kernel: the same time at both ends

    monkeypatch.setattr(tune_module, "bench", bench)
    ctx = Context(get_target("cuda:sm_90"),
                  {"tune_compiler": CRASHY + "compile_counting", "tune": "full",
                   "example_env": {"s0": 8, "s1": 16}})
    spec = add_spec(D256, [D512, SLOW], n=s0 * s1)
    kernel = choose(region, spec, ctx.target, ctx, plan)
    assert set(benched) == {1, 8}  # both ends of the batch
    assert isinstance(kernel, TritonKernel) and kernel.config == D256, region.notes[-1]
    assert "host cost added" in region.notes[-1]
