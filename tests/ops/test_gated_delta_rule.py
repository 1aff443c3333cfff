"""kiln.ops.gated_delta_rule against the recurrence it defines, written out step by step
here; inside kiln.compile (one extern region, dynamic T); kept whole by torch.export;
bad input refused with kiln's errors."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.errors import ArgumentError, DTypeError, KilnError, ShapeError
from kiln.ops import gated_delta_rule
from tests.helpers import rel_err


def reference(q, k, v, g, beta, scale, state):
    """S_t = S_{t-1} exp(g_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T; o_t = S_t q_t scale.

    One sequence per batch row; S is [B, HV, V, K] here (the formula's orientation)."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    rep = HV // H
    q, k = q.repeat_interleave(rep, 2).double(), k.repeat_interleave(rep, 2).double()
    v, g, beta = v.double(), g.double(), beta.double()
    S = state.double().transpose(-1, -2).clone()
    eye = torch.eye(K, dtype=torch.float64)
    out = []
    for t in range(T):
        kt, vt = k[:, t], v[:, t]  # [B, HV, K], [B, HV, V]
        b = beta[:, t][..., None, None]
        proj = eye - b * kt[..., :, None] * kt[..., None, :]
        S = S * g[:, t].exp()[..., None, None] @ proj + b * vt[..., :, None] * kt[..., None, :]
        out.append(S @ (q[:, t] * scale)[..., None])
    return torch.stack(out, 1)[..., 0], S.transpose(-1, -2)


def inputs(B, T, H, HV, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)  # as models feed it
    v = torch.randn(B, T, HV, V, generator=gen)
    g = -F.softplus(torch.randn(B, T, HV, generator=gen))  # log decay <= 0, fp32
    beta = torch.rand(B, T, HV, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("T", [1, 37, 150])  # one step, one chunk, several padded chunks
def test_matches_the_recurrence(T):
    B, H, HV, K, V = 2, 2, 4, 16, 8  # value heads = 2 x key heads
    q, k, v, g, beta = inputs(B, T, H, HV, K, V)
    state = torch.randn(B, HV, K, V)
    o, final = gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)
    ref_o, ref_s = reference(q, k, v, g, beta, K ** -0.5, state)
    assert o.shape == v.shape and o.dtype == v.dtype
    assert final.shape == (B, HV, K, V) and final.dtype == torch.float32
    assert rel_err(o, ref_o) <= 1e-5, rel_err(o, ref_o)
    assert rel_err(final, ref_s) <= 1e-5, rel_err(final, ref_s)


def test_defaults_zero_state_and_no_final_state():
    q, k, v, g, beta = inputs(1, 9, 2, 2, 8, 8)
    o, final = gated_delta_rule(q, k, v, g, beta, scale=0.3)
    ref_o, _ = reference(q, k, v, g, beta, 0.3, torch.zeros(1, 2, 8, 8))
    assert final is None
    assert rel_err(o, ref_o) <= 1e-5


def test_varlen_cu_seqlens_runs_each_sequence_from_its_state():
    H, HV, K, V = 2, 4, 16, 8
    cu = [0, 5, 17, 40]
    q, k, v, g, beta = inputs(1, cu[-1], H, HV, K, V, seed=1)
    states = torch.randn(len(cu) - 1, HV, K, V)
    o, final = gated_delta_rule(q, k, v, g, beta, initial_state=states, output_final_state=True,
                                cu_seqlens=torch.tensor(cu))
    assert final.shape == (3, HV, K, V)
    for n, (s, e) in enumerate(zip(cu, cu[1:])):
        part = [x[:, s:e] for x in (q, k, v, g, beta)]
        ref_o, ref_s = reference(*part, K ** -0.5, states[n:n + 1])
        assert rel_err(o[:, s:e], ref_o) <= 1e-5, (n, rel_err(o[:, s:e], ref_o))
        assert rel_err(final[n:n + 1], ref_s) <= 1e-5


def test_bf16_inputs_give_bf16_output_and_fp32_state():
    q, k, v, g, beta = inputs(1, 20, 2, 2, 16, 16)
    o, final = gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(),
                                output_final_state=True)
    ref_o, ref_s = reference(q, k, v, g, beta, 0.25, torch.zeros(1, 2, 16, 16))
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert rel_err(o, ref_o) <= 2e-2 and rel_err(final, ref_s) <= 2e-2


class DeltaLayer(torch.nn.Module):
    """A small linear-attention block: projections around the op, state in and out."""

    def __init__(self, dim=32, H=2, HV=4, K=8, V=8):
        super().__init__()
        self.H, self.HV, self.K, self.V = H, HV, K, V
        self.qk = torch.nn.Linear(dim, 2 * H * K)
        self.v = torch.nn.Linear(dim, HV * V)
        self.gb = torch.nn.Linear(dim, 2 * HV)
        self.out = torch.nn.Linear(HV * V, dim)

    def forward(self, x, state):
        B, T, _ = x.shape
        q, k = self.qk(x).view(B, T, 2, self.H, self.K).unbind(2)
        k = F.normalize(k, dim=-1)
        v = self.v(x).view(B, T, self.HV, self.V)
        a, b = self.gb(x).chunk(2, dim=-1)
        o, new_state = gated_delta_rule(q, k, v, -F.softplus(a), b.sigmoid(),
                                        initial_state=state, output_final_state=True)
        return self.out(o.reshape(B, T, -1)), new_state


def test_compiles_for_the_cpu_with_a_dynamic_sequence(tmp_path):
    torch.manual_seed(0)
    model = DeltaLayer().eval()
    x, state = torch.randn(1, 12, 32), torch.randn(1, 4, 8, 8)
    T = kiln.Dim("seq", min=1, max=256)
    compiled = kiln.compile(model, (x, state), dynamic_shapes=({1: T}, None), target="cpu")
    for t in (12, 1, 37, 100):
        x, state = torch.randn(1, t, 32), torch.randn(1, 4, 8, 8)
        out, new_state = compiled(x, state)
        ref, ref_state = model(x, state)
        assert rel_err(out, ref) <= 1e-5 and rel_err(new_state, ref_state) <= 1e-5, t
    regions = [r for r in compiled.program.plan.regions
               if any(op.target == "kiln.gated_delta_rule.default" for op in r.ops)]
    assert len(regions) == 1 and regions[0].kind == "extern"
    compiled.save(tmp_path / "delta.kiln")  # the op is found again by name when loaded
    loaded = kiln.load(tmp_path / "delta.kiln")
    for a, b in zip(loaded(x, state), compiled(x, state)):
        assert torch.equal(a, b)


def test_torch_export_keeps_the_op_whole():
    model = DeltaLayer().eval()
    ep = torch.export.export(model, (torch.randn(1, 12, 32), torch.randn(1, 4, 8, 8)),
                             dynamic_shapes=({1: torch.export.Dim("seq", max=256)}, None))
    ep = ep.run_decompositions()
    calls = [n for n in ep.graph.nodes if n.op == "call_function"
             and n.target == torch.ops.kiln.gated_delta_rule.default]
    assert len(calls) == 1
    assert not any("triangular" in str(n.target) or "cumsum" in str(n.target)
                   for n in ep.graph.nodes)


BAD = {
    "k shape": (dict(k=(1, 6, 2, 8)), ShapeError),
    "K mismatch": (dict(k=(1, 5, 2, 4)), ShapeError),
    "heads not a multiple": (dict(v=(1, 5, 3, 8), g=(1, 5, 3), beta=(1, 5, 3)), ShapeError),
    "v time": (dict(v=(1, 4, 2, 8)), ShapeError),
    "g shape": (dict(g=(1, 5, 4)), ShapeError),
    "q rank": (dict(q=(5, 2, 8)), ShapeError),
    "state shape": (dict(initial_state=(1, 2, 8, 4)), ShapeError),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_shapes_are_shape_errors(case):
    shapes, error = BAD[case]
    base = dict(q=(1, 5, 2, 8), k=(1, 5, 2, 8), v=(1, 5, 2, 8), g=(1, 5, 2), beta=(1, 5, 2))
    base.update(shapes)
    state = base.pop("initial_state", None)
    args = {n: torch.randn(s) for n, s in base.items()}
    with pytest.raises(error) as e:
        gated_delta_rule(**args, initial_state=None if state is None else torch.randn(state))
    assert isinstance(e.value, KilnError) and "gated_delta_rule" in str(e.value)


def test_cu_seqlens_needs_a_batch_of_one_and_valid_bounds():
    q, k, v, g, beta = inputs(2, 6, 1, 1, 4, 4)
    with pytest.raises(ShapeError, match="batch must be 1"):
        gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 3, 6]))
    q, k, v, g, beta = inputs(1, 6, 1, 1, 4, 4)
    with pytest.raises(ArgumentError, match="does not split"):
        gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 3]))
    with pytest.raises(ArgumentError, match="does not split"):
        gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ArgumentError, match="int32/int64"):
        gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0.0, 6.0]))


def test_bad_scale_empty_heads_state_and_cu_seqlens_are_kiln_errors():
    """Each had reached a raw ValueError / ZeroDivisionError / AttributeError, an export
    failure (cu_seqlens [] made -1 states), or ran an int state as if it were a float."""
    q, k, v, g, beta = inputs(1, 5, 1, 2, 4, 4)
    cases = [
        (dict(scale="0.5"), ArgumentError, "scale must be a number"),
        (dict(initial_state=torch.zeros(1, 2, 4, 4, dtype=torch.int32)), DTypeError,
         "floating-point"),
        (dict(initial_state=[[0.0]]), DTypeError, "floating-point"),
        (dict(cu_seqlens=[0, 2, 5]), ArgumentError, "non-empty 1-d"),
        (dict(cu_seqlens=torch.tensor([], dtype=torch.int32)), ArgumentError, "non-empty"),
    ]
    for kw, error, match in cases:
        with pytest.raises(error, match=match):
            gated_delta_rule(q, k, v, g, beta, **kw)
    empty = torch.randn(1, 5, 1, 0)  # K = 0
    with pytest.raises(ShapeError, match="at least 1"):
        gated_delta_rule(empty, empty, v, g, beta)

    class Packed(torch.nn.Module):
        def forward(self, q, k, v, g, beta, cu):
            return gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)[0]

    with pytest.raises(ArgumentError, match="non-empty"):  # not an ExportError
        kiln.compile(Packed(), (q, k, v, g, beta, torch.tensor([], dtype=torch.int32)))
