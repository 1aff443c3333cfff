"""Generated pointwise kernels in Triton's interpreter vs eager, per op family, with a
dynamic dim (so sizes are kernel arguments) and sizes that leave a masked tail."""

import pytest
import torch
import torch.nn.functional as F

from kiln.codegen.build.triton_kernel import TritonKernel
from tests.codegen.gen_helpers import assert_matches, compile_interpret, triton_kernels

T = torch.export.Dim("T", min=2, max=64)


class FloatMath(torch.nn.Module):
    """Every float elementwise family, one output each (stacked into one region)."""

    def forward(self, x, y):
        p = x.abs() + 0.5  # positive, for logs, roots and powers
        u = torch.sigmoid(x) * 0.9 + 0.05  # in (0, 1), for logit
        outs = [
            torch.add(x, y, alpha=2.0), torch.sub(x, y, alpha=0.5), torch.rsub(x, 3.0), x * y,
            x / (y.abs() + 0.1), torch.div(x, y + 3.0, rounding_mode="trunc"),
            torch.div(x * 4.0, y + 3.0, rounding_mode="floor"), torch.remainder(x * 3, y + 3.0),
            torch.fmod(x * 3, y + 3.0), p ** 2, p ** 0.5, p ** 3, p ** 2.5, p ** -1, p ** y,
            2.0 ** x, x.exp(), torch.exp2(x), p.log(), p.log2(), torch.log1p(p), torch.expm1(x),
            p.sqrt(), p.rsqrt(), p.reciprocal(), x.sin(), x.cos(), torch.tan(x * 0.5), x.tanh(),
            torch.sinh(x), torch.cosh(x), torch.sigmoid(x), F.silu(x), F.gelu(x),
            F.gelu(x, approximate="tanh"), torch.erf(x), F.relu(x), F.leaky_relu(x, 0.1),
            F.elu(x), F.softplus(x), F.hardtanh(x), torch.logit(u), torch.logit(u, eps=0.2),
            x.neg(), x.sign(), (x * 3).floor(), (x * 3).ceil(), (x * 3).round(),
            (x * 3).trunc(), torch.maximum(x, y), torch.minimum(x, y), x.clamp(-0.5, 0.5),
            x.clamp(min=0.1), x.clamp(max=-0.1), torch.clamp(x, y - 1, y + 1),
            torch.lerp(x, y, 0.3), torch.lerp(x, y, 0.8), torch.where(x > y, x, 2.0),
            x.masked_fill(x < 0, -1.5),
        ]
        return torch.stack(outs)


def test_float_math_fp32():
    x, y = torch.randn(3, 7, 5), torch.randn(5)
    exe = compile_interpret(FloatMath(), (x, y), ({1: T}, None))
    for t in (7, 2, 9):
        x = torch.randn(3, t, 5)
        x[0, 0, :3] = torch.tensor([0.5, -2.5, 1.5]) / 3  # round-half-to-even cases
        assert_matches(exe(x, y), FloatMath()(x, y), 1e-5)


def test_special_values_propagate_like_torch():
    class M(torch.nn.Module):
        def forward(self, x, y):
            return torch.stack([torch.maximum(x, y), torch.minimum(x, y), x.clamp(-1, 1),
                                F.relu(x), x.sign(), x.isnan().float(), x.isinf().float()])

    x = torch.tensor([[float("nan"), 1.0, float("inf"), -float("inf"), 0.0, -2.0]])
    y = torch.tensor([[0.0, float("nan"), 1.0, 2.0, -0.0, float("nan")]])
    exe = compile_interpret(M(), (x, y))
    assert_matches(exe(x, y), M()(x, y), 0.0)


class IntMath(torch.nn.Module):
    def forward(self, a, b):
        b = b.abs() + 1
        outs = [a + b, a - 2 * b, a * b, a // b, torch.div(a, b, rounding_mode="trunc"),
                torch.remainder(a, b), torch.fmod(a, b), a & b, a | b, a ^ b, ~a, a.abs(),
                -a, a ** 3, torch.maximum(a, b), torch.minimum(a, b), a.clamp(-3, 3),
                a.sign(), torch.where(a > b, a, b)]
        return torch.stack(outs), (a / b), (a > 2) & (b < 4), torch.logical_xor(a > 0, b > 2)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_math_stays_integer(dtype):
    a = torch.randint(-9, 9, (4, 6), dtype=dtype)
    b = torch.randint(-9, 9, (4, 6), dtype=dtype)
    exe = compile_interpret(IntMath(), (a, b), ({0: T}, {0: T}))
    a, b = (torch.randint(-9, 9, (5, 6), dtype=dtype) for _ in range(2))
    assert_matches(exe(a, b), IntMath()(a, b), 1e-6)


class Casts(torch.nn.Module):
    def forward(self, x, n, m):
        return (x.half().float(), x.to(torch.bfloat16), (x * 10).to(torch.int32),
                n.float() * 0.5, m.float() + 1, (x > 0).to(torch.int64) * n, x.bool(),
                torch.logical_not(m), torch.logical_and(m, x > 0) | (n > 3))


def test_casts_and_bools():
    x, n = torch.randn(6, 5), torch.randint(0, 9, (6, 5))
    m = torch.rand(6, 5) > 0.5
    x[0, 0] = 0.0
    exe = compile_interpret(Casts(), (x, n, m), ({0: T}, {0: T}, {0: T}))
    x, n, m = torch.randn(9, 5), torch.randint(0, 9, (9, 5)), torch.rand(9, 5) > 0.5
    assert_matches(exe(x, n, m), Casts()(x, n, m), 1e-6)


class HalfChain(torch.nn.Module):
    """Low-precision math: torch computes each op in fp32 and rounds per op."""

    def forward(self, x, y, z):
        return (x * y + z, F.silu(x) * y, (x.float() * 2.5).to(x.dtype), x + 1.5,
                torch.rsqrt(x.abs() + 1) * z, x * y.float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_follows_torch_promotion(dtype):
    x, y, z = (torch.randn(2, 7, 16).to(dtype) for _ in range(3))
    exe = compile_interpret(HalfChain(), (x, y, z), ({1: T}, {1: T}, {1: T}))
    assert_matches(exe(x, y, z), HalfChain()(x, y, z), 1e-2)


class Views(torch.nn.Module):
    def forward(self, x, c):
        # x [B, T, 12], c [T, 1]
        B, L, _ = x.shape
        a = x.view(B, L, 3, 4).permute(0, 2, 1, 3)  # [B, 3, T, 4]
        b = x.transpose(1, 2)[:, 1::3, :]  # slice with a step
        d = x[:, :, 5] + c.squeeze(1)  # select
        e = x.unsqueeze(0).expand(2, B, L, 12)
        h1, h2 = x.chunk(2, dim=-1)
        f = torch.cat([-h2, h1], dim=-1) * x  # rotate_half (split pieces + cat)
        return a * 2, b + 1, d, e * 1.0, f, x.reshape(B * L, 12)[:, :6] - 1, c + x[0, :, :1]


def test_views_compose_into_index_maps():
    x, c = torch.randn(2, 5, 12), torch.randn(5, 1)
    exe = compile_interpret(Views(), (x, c), ({1: T}, {0: T}))
    x, c = torch.randn(2, 7, 12), torch.randn(7, 1)
    assert_matches(exe(x, c), Views()(x, c), 1e-6)


class Gathers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)

    def forward(self, tok, x, i, j):
        # tok [1, T], x [4, 5, 6], i / j index vectors (may be negative)
        return (self.emb(tok) * 2, x[:, i], x[i, :, j], x[j], x.index_select(1, i.abs()),
                torch.gather(x, 2, (tok[:, :1].abs() % 6).expand(4, 5, 1)),
                x[:, None, i].float())


def test_gathers_load_indirectly():
    tok = torch.randint(0, 11, (1, 4))
    x = torch.randn(4, 5, 6)
    i, j = torch.tensor([0, -1, 2]), torch.tensor([3, -2, 1])
    model = Gathers()
    exe = compile_interpret(model, (tok, x, i, j), ({1: T}, None, None, None))
    tok = torch.randint(0, 11, (1, 9))
    assert_matches(exe(tok, x, i, j), model(tok, x, i, j), 1e-6)


class CatPad(torch.nn.Module):
    def forward(self, a, b, c):
        # a [T, 3], b [T, 5], c [2, 3]
        return (torch.cat([a, b, a * 2], dim=1), torch.cat([a, c], dim=0) + 1,
                F.pad(a, (2, 1), value=-3.0), F.pad(b, (-1, 2, 1, 0)), F.pad(a, (0, 0, 1, 1)))


def test_cat_and_pad_select_per_element():
    a, b, c = torch.randn(4, 3), torch.randn(4, 5), torch.randn(2, 3)
    exe = compile_interpret(CatPad(), (a, b, c), ({0: T}, {0: T}, None))
    a, b = torch.randn(7, 3), torch.randn(7, 5)
    assert_matches(exe(a, b, c), CatPad()(a, b, c), 1e-6)


class Creates(torch.nn.Module):
    def forward(self, x):
        L = x.shape[0]
        pos = torch.arange(L)
        causal = pos[None, :] <= pos[:, None]
        return (x + torch.arange(L, dtype=torch.float32)[:, None] * 0.5,
                torch.where(causal, 0.0, float("-inf")), x * torch.full_like(x, 3.0),
                torch.arange(2, 2 + 3 * L, 3) * 2, x * L + torch.full((L, L), L))


def test_created_tensors_are_computed_inline():
    x = torch.randn(5, 5)
    exe = compile_interpret(Creates(), (x,), ({0: T, 1: T},))
    for k in triton_kernels(exe):  # nothing but x is read: aranges and fills are computed
        assert {a.value for a in k.spec.args if a.kind == "tensor"} <= {"x", *k.region.outputs}
    x = torch.randn(9, 9)
    assert_matches(exe(x), Creates()(x), 1e-6)


def test_sixty_four_bit_indexing_only_when_bounds_require_it():
    class M(torch.nn.Module):
        def forward(self, x):
            return x * 2

    small = compile_interpret(M(), (torch.randn(4, 8),), ({0: T},))
    assert all(k.spec.index_bits == 32 for k in triton_kernels(small))
    unbounded = torch.export.Dim("N", min=2)
    big = compile_interpret(M(), (torch.randn(4, 8),), ({0: unbounded},))
    (k,) = triton_kernels(big)
    assert k.spec.index_bits == 64 and "tl.program_id(0).to(tl.int64)" in k.spec.source
    x = torch.randn(5, 8)
    assert_matches(big(x), M()(x), 0.0)


def test_unsupported_op_runs_extern_with_a_note():
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.asin(x * 0.5) + 1  # no interpreter form for asin

    x = torch.randn(6, 4)
    exe = compile_interpret(M(), (x,), require_triton=False)
    (r,) = exe.plan.regions
    assert not isinstance(exe.program.kplan.kernels[r.name], TritonKernel)
    assert any("asin" in n for n in r.notes), r.notes
    assert_matches(exe(x), M()(x), 1e-6)
