"""Bad calls of a compiled module: each a KilnError naming the offending thing."""

import pytest
import torch

import kiln
from kiln.errors import ArgumentError, DeviceError, DTypeError, KilnError, ShapeError


class Scale(torch.nn.Module):
    def forward(self, x, y):
        return x * 2 + y.sum(-1, keepdim=True)


@pytest.fixture(scope="module")
def exe():
    T = kiln.Dim("T", min=2, max=16)
    args = (torch.randn(4, 8), torch.randn(4, 3))
    return kiln.compile(Scale(), args, dynamic_shapes=({0: T}, {0: T}))


def test_good_call_in_bounds(exe):
    for t in (2, 9, 16):
        x, y = torch.randn(t, 8), torch.randn(t, 3)
        torch.testing.assert_close(exe(x, y), x * 2 + y.sum(-1, keepdim=True))


def test_size_above_bound_names_dim_bound_and_argument(exe):
    with pytest.raises(ShapeError) as e:
        exe(torch.randn(17, 8), torch.randn(17, 3))
    msg = str(e.value)
    assert "'x'" in msg and "17" in msg and "[2, 16]" in msg and 'dim "T"' in msg


def test_size_below_bound(exe):
    with pytest.raises(ShapeError, match=r"\[2, 16\]"):
        exe(torch.randn(1, 8), torch.randn(1, 3))


def test_static_dim_mismatch(exe):
    with pytest.raises(ShapeError, match="dim 1"):
        exe(torch.randn(4, 9), torch.randn(4, 3))


def test_shared_dim_disagrees(exe):
    with pytest.raises(ShapeError, match='dim "T" .*is already 4'):
        exe(torch.randn(4, 8), torch.randn(5, 3))


def test_wrong_rank(exe):
    with pytest.raises(ShapeError, match="'y'"):
        exe(torch.randn(4, 8), torch.randn(4, 3, 1))


def test_wrong_dtype(exe):
    with pytest.raises(DTypeError, match="'x'.*f64.*f32"):
        exe(torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 3))


def test_wrong_number_of_arguments(exe):
    with pytest.raises(ArgumentError, match="2 positional"):
        exe(torch.randn(4, 8))
    with pytest.raises(ArgumentError, match="2 positional.*got 3"):
        exe(torch.randn(4, 8), torch.randn(4, 3), torch.randn(1))


def test_not_a_tensor(exe):
    with pytest.raises(ArgumentError, match="argument 1 must be a tensor, got list"):
        exe(torch.randn(4, 8), [1.0, 2.0, 3.0])


def test_wrong_device_is_named():
    exe = kiln.compile(Scale(), (torch.randn(4, 8), torch.randn(4, 3)))
    meta = torch.randn(4, 8, device="meta")
    with pytest.raises(DeviceError, match="meta"):
        exe(meta, torch.randn(4, 3))


def test_unbounded_dim_accepts_large_sizes():
    T = kiln.Dim("T", min=1)
    exe = kiln.compile(Scale(), (torch.randn(4, 8), torch.randn(4, 3)),
                       dynamic_shapes=({0: T}, {0: T}))
    assert exe.plan.symbols[next(iter(exe.plan.symbols))].hi is None
    x, y = torch.randn(5000, 8), torch.randn(5000, 3)
    torch.testing.assert_close(exe(x, y), x * 2 + y.sum(-1, keepdim=True))


def test_bad_call_leaves_state_untouched():
    """A rejected call runs nothing: the KV cache is not half-updated."""
    from kiln.models.llama import example_inputs, tiny_llama

    model = tiny_llama()
    args, dynamic = example_inputs(model.cfg, seq_len=4)
    exe = kiln.compile(model, args, dynamic_shapes=dynamic)
    before = [b.clone() for b in model.buffers()]
    with pytest.raises(ShapeError, match="200"):
        exe(torch.zeros(1, 200, dtype=torch.long), torch.arange(200))
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))


# ---- the user's Dim names in messages -------------------------------------------------


class AddOne(torch.nn.Module):
    def forward(self, x):
        return x + 1


@pytest.fixture(scope="module")
def seq_exe():
    seq = kiln.Dim("seq", min=1, max=64)
    return kiln.compile(AddOne(), (torch.randn(2, 8, 4),), dynamic_shapes=({1: seq},))


def _bound_error(module) -> str:
    with pytest.raises(ShapeError) as e:
        module(torch.randn(2, 100, 4))
    return str(e.value)


def test_out_of_bounds_says_the_users_dim_name(seq_exe):
    msg = _bound_error(seq_exe)
    sym = next(iter(seq_exe.plan.symbols))
    assert f'dim "seq" ({sym})' in msg and "100" in msg and "[1, 64]" in msg


def test_dim_name_survives_save_and_load(seq_exe, tmp_path):
    seq_exe.save(tmp_path / "m.kiln")
    loaded = kiln.load(tmp_path / "m.kiln")
    assert 'dim "seq"' in _bound_error(loaded)
    assert loaded.plan.dim_names == seq_exe.plan.dim_names


class Doubled(torch.nn.Module):
    def forward(self, x, y):
        return x.sum(0) + y.sum(0)


def test_derived_dim_mismatch_names_the_dim():
    t = kiln.Dim("t", min=2, max=16)
    exe = kiln.compile(Doubled(), (torch.randn(4, 3), torch.randn(8, 3)),
                       dynamic_shapes=({0: t}, {0: 2 * t}))
    with pytest.raises(ShapeError, match='must equal 2[*]s[0-9]+ [(]s[0-9]+ is dim "t"[)] = 10'):
        exe(torch.randn(5, 3), torch.randn(9, 3))


def test_only_a_derived_dim_binds_its_root():
    """Wav2Vec2 with `10 * samples`: no input dim is the root symbol itself."""
    t = kiln.Dim("t", min=2, max=16)
    exe = kiln.compile(AddOne(), (torch.randn(20, 3),), dynamic_shapes=({0: 10 * t},))
    x = torch.randn(70, 3)
    torch.testing.assert_close(exe(x), x + 1)
    with pytest.raises(ShapeError, match='must be 10[*]s[0-9]+ [(]s[0-9]+ is dim "t"[)]'):
        exe(torch.randn(75, 3))
    with pytest.raises(ShapeError, match=r"size 170 [(]10[*]s[0-9]+ .* = 17[)] .*\[2, 16\]"):
        exe(torch.randn(170, 3))


def test_fast_binder_agrees_with_bind_symbols(exe):
    """Every call: the fast check's sizes are bind_symbols' sizes, or it declines (None)
    exactly where bind_symbols raises its message."""
    from kiln.runtime.guards import FastBinder, bind_symbols

    fast = FastBinder(exe.plan, "cpu")
    r = torch.randn
    calls = [(r(4, 8), r(4, 3)), (r(16, 8), r(16, 3)), (r(2, 8), r(2, 3)), (r(17, 8), r(17, 3)),
             (r(1, 8), r(1, 3)), (r(4, 9), r(4, 3)), (r(4, 8), r(5, 3)), (r(4, 8), r(4, 3, 1)),
             (r(4, 8, dtype=torch.float64), r(4, 3)), (r(4, 8),), (r(4, 8), 3.0),
             (r(4, 8, device="meta"), r(4, 3))]
    for args in calls:
        try:
            want = bind_symbols(exe.plan, args, "cpu")
        except KilnError:
            want = None
        assert fast(args) == want, [tuple(getattr(a, "shape", ())) for a in args]
