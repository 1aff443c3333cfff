"""A gated delta rule decode step takes its prologue, the gated RMSNorm of its output and
its state write into its kernel (kiln.dispatch.fold_delta_step, fold_delta_state;
templates/gated_delta/step_fusion.py): the plan holds one region for them, and under
the `interpret` target the step's outputs and state match eager over several steps."""

import copy
import sys

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.ir.plan import RegionKind
from tests.helpers import rel_err

OP = "kiln.gated_delta_rule.default"
H, HV, K, V, DIM = 2, 4, 16, 8, 32


def l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class Step(torch.nn.Module):
    """One linear-attention step as a model writes it: q, k, v, z, b, a from one
    projection, q and k l2-normalised, the gates from b and a, the state buffer read
    (zeros for a row at position 0) and written back, the output's RMSNorm over each
    value head times SiLU(z). `pairs`: q is summed over pairs of rows first (a reduction
    the kernel cannot compute per program: its prologue is split out)."""

    def __init__(self, rows=2, pairs=False):
        super().__init__()
        self.pairs = pairs
        self.proj = torch.nn.Linear(
            DIM, (3 if pairs else 2) * H * K + 2 * HV * V + 2 * HV, bias=False)
        self.norm = torch.nn.Parameter(1 + 0.1 * torch.randn(V))
        self.register_buffer("state", torch.randn(rows, HV, K, V))

    def forward(self, x, pos):
        B = x.shape[0]
        qw = (2 if self.pairs else 1) * H * K
        q, k, v, z, b, a = self.proj(x).split([qw, H * K, HV * V, HV * V, HV, HV], dim=-1)
        if self.pairs:
            q = q.view(B, 1, H, 2, K).sum(-2)
        q = l2norm(q.reshape(B, 1, H, K).float())
        k = l2norm(k.reshape(B, 1, H, K).float())
        v = F.silu(v).reshape(B, 1, HV, V)
        beta, g = b.sigmoid(), -F.softplus(a.float() + 1.0)
        fresh = (pos[:, 0] == 0)[:, None, None, None]
        state = torch.where(fresh, 0, self.state[:B])
        o, new = kiln.ops.gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                           output_final_state=True)
        self.state[torch.arange(B, device=x.device)] = new
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return o * F.silu(z.reshape(B, 1, HV, V))


def _steps(exe, model, calls):
    for x, pos in calls:
        assert rel_err(exe(x, pos), model(x, pos)) <= 1e-5
    state = next(t for n, t in exe.state.items() if n.endswith("state"))
    assert rel_err(state, model.state) <= 1e-5


def _step_region(exe):
    return next(r for r in exe.plan.regions if any(op.target == OP for op in r.ops))


def _batched(model, x, pos, target="interpret", **kw):
    """`model` (a copy) compiled for batches of 1 or 2 rows."""
    batch = kiln.Dim("batch", min=1, max=2)
    return kiln.compile(copy.deepcopy(model), (x, pos), target=target,
                        dynamic_shapes=({0: batch}, {0: batch}), **kw)


def test_the_step_takes_its_prologue_and_state_write_and_matches_eager():
    torch.manual_seed(0)
    model = Step()
    x, pos = torch.randn(2, 1, DIM), torch.tensor([[3], [0]])
    exe = _batched(model, x, pos)
    step = _step_region(exe)
    assert step.kind == RegionKind.EXTERN and list(step.inplace.values()) == ["b_state"]
    assert any(n.startswith("epilogue: region") for n in step.notes), step.notes
    assert isinstance(exe.program.kplan.kernels[step.name], TritonKernel)
    # the projection, and the step holding the rest: conv-free here, so nothing else
    others = [r for r in exe.plan.regions if r is not step]
    assert all(r.kind in (RegionKind.MATMUL, RegionKind.POINTWISE) for r in others), others
    assert not any("b_state" in r.inputs for r in others)
    _steps(exe, model, [(x, pos), (torch.randn(2, 1, DIM), pos + 1),
                        (torch.randn(1, 1, DIM), torch.tensor([[5]]))])


def test_a_prologue_the_kernel_cannot_compute_is_split_out_again():
    torch.manual_seed(1)
    model = Step(rows=1, pairs=True)
    x, pos = torch.randn(1, 1, DIM), torch.tensor([[2]])
    exe = kiln.compile(copy.deepcopy(model), (x, pos), target="interpret")
    step = _step_region(exe)
    assert any("the template declines" in n for n in step.notes), step.notes
    assert isinstance(exe.program.kplan.kernels[step.name], TritonKernel)
    _steps(exe, model, [(x, pos), (torch.randn(1, 1, DIM), pos + 1)])


def test_the_cpu_target_keeps_the_regions_apart():
    model = Step(rows=1)
    exe = kiln.compile(model, (torch.randn(1, 1, DIM), torch.tensor([[2]])))
    step = _step_region(exe)
    assert not step.inplace and not any("prologue" in n for n in step.notes)


def _widths(monkeypatch, **sizes):
    mod = sys.modules[__name__]
    for name, value in sizes.items():
        monkeypatch.setattr(mod, name, value)


def test_a_head_split_over_programs_runs_the_epilogue_in_the_last_to_arrive(monkeypatch):
    """Value heads wider than the default block (64 columns: two programs a head) keep
    the gated RMSNorm over each whole head: the last program of a head to finish reads
    the others' output back and runs it; the counters are left zero for the next call."""
    _widths(monkeypatch, V=64)
    torch.manual_seed(2)
    model = Step()
    x, pos = torch.randn(2, 1, DIM), torch.tensor([[3], [0]])
    exe = _batched(model, x, pos)
    kernel = exe.program.kplan.kernels[_step_region(exe).name]
    assert kernel.config["BV"] == 32 and "gd_arrived" in kernel.spec.source
    _steps(exe, model, [(x, pos), (torch.randn(2, 1, DIM), pos + 1),
                        (torch.randn(1, 1, DIM), torch.tensor([[5]])),
                        (torch.randn(2, 1, DIM), pos + 2)])


def test_the_qwen3_next_step_splits_its_heads_and_spills_nothing(monkeypatch):
    """At Qwen3-Next's widths (16 key heads, 32 value heads of 128) whole heads a program
    are 32 programs of a 128 x 128 fp32 state block (7.8 us on an H200 on 4 warps,
    against 12.7 on 8): the default takes 32 columns a program (128 programs, the
    epilogue in the last of each head's four), and both compile for sm_90 without
    spilling."""
    from kiln.codegen.build.compiler import compile_binary
    from kiln.codegen.build.spec import Config
    from kiln.codegen.templates.gated_delta import template as gated_delta
    from kiln.target import get_target

    _widths(monkeypatch, H=16, HV=32, K=128, V=128, DIM=256)
    torch.manual_seed(0)
    model = Step(rows=1).to(torch.bfloat16)
    x, pos = torch.randn(1, 1, 256, dtype=torch.bfloat16), torch.tensor([[3]])
    exe = kiln.compile(model, (x, pos), target="interpret")
    sm90 = get_target("cuda:sm_90")
    spec = gated_delta.generate(_step_region(exe), exe.plan, sm90)
    assert (spec.default["BV"], spec.default.num_warps) == (32, 4)
    assert {c["BV"] for c in spec.configs} >= {128, 32}
    for config in (spec.default, Config.make(4, 1, CHUNK=16, BV=128)):
        assert compile_binary(spec, config, sm90).resources.spills == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_split_step_matches_eager_on_cuda_at_qwen3_next_widths(monkeypatch, dtype):
    """The head-split step (four programs a head, the epilogue in the last to arrive) on
    the GPU, over steps that reuse its counters, tuning off (the default config)."""
    _widths(monkeypatch, H=16, HV=32, K=128, V=128, DIM=256)
    torch.manual_seed(3)
    model = Step().to(dtype).cuda()
    model.state = model.state.float()  # the op's state is fp32, as a model keeps it
    x, pos = torch.randn(2, 1, DIM, dtype=dtype, device="cuda"), torch.tensor([[3], [0]])
    exe = _batched(model, x, pos.cuda(), "cuda", options={"tune": "none"})
    assert exe.program.kplan.kernels[_step_region(exe).name].config["BV"] == 32
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i in range(3):
        x = torch.randn(2 - i % 2, 1, DIM, dtype=dtype, device="cuda")
        p = (pos[:x.shape[0]] + i).cuda()
        assert rel_err(exe(x, p).float(), model(x, p).float()) <= tol
    state = next(t for n, t in exe.state.items() if n.endswith("state"))
    assert rel_err(state.float(), model.state.float()) <= tol
