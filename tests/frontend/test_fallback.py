"""An op kiln has no kernel for runs as PyTorch's own op, the rest still compiled;
fallback="error" refuses them all at once; ops with a decomposition into what kiln fuses
(eval BatchNorm, bilinear upsampling) are decomposed, not fallen back."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.errors import ArgumentError, KilnWarning, UnsupportedOpError


class Unusual(torch.nn.Module):
    """median, bucketize, embedding_bag and an FFT between ops kiln generates."""

    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(10, 6, mode="mean")
        self.register_buffer("edges", torch.tensor([-0.5, 0.0, 0.5]))

    def forward(self, x, ids):
        h = torch.tanh(x * 2)
        med = h.median(dim=-1).values
        buckets = torch.bucketize(h, self.edges).float()
        spectrum = torch.fft.rfft(h, dim=-1).abs()
        bag = self.bag(ids)
        return med.unsqueeze(-1) + buckets.sum(-1, keepdim=True) + spectrum[..., :2].sum(-1) \
            .unsqueeze(-1) + bag.sum(-1, keepdim=True)


def _args(rows=4):
    return torch.randn(rows, 6), torch.randint(0, 10, (rows, 3))


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_unsupported_ops_fall_back_and_match_eager(target):
    model = Unusual().eval()
    args = _args()
    with pytest.warns(KilnWarning) as caught:
        exe = kiln.compile(model, args, target=target)
    text = str(caught[0].message)
    for op in ("aten.median.dim", "aten.bucketize.Tensor", "aten._fft_r2c.default"):
        assert text.count(op) == 1, text
    assert "test_fallback.py" in text  # the user's line
    assert len(caught) == 1
    fresh = _args()
    torch.testing.assert_close(exe(*fresh), model(*fresh), rtol=1e-5, atol=1e-5)
    explained = exe.explain()
    assert "fallback: kiln has no kernel for aten.median.dim" in explained
    # the ops around the fallbacks are still kiln's own regions
    assert "pointwise" in explained


def test_fallback_with_a_dynamic_dim():
    model = Unusual().eval()
    rows = kiln.Dim("rows", min=2, max=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KilnWarning)
        exe = kiln.compile(model, _args(4), dynamic_shapes=({0: rows}, {0: rows}))
    for n in (2, 9, 33):
        args = _args(n)
        torch.testing.assert_close(exe(*args), model(*args), rtol=1e-5, atol=1e-5)


def test_fallback_error_lists_every_unsupported_op_at_once():
    with pytest.raises(UnsupportedOpError) as e:
        kiln.compile(Unusual().eval(), _args(), fallback="error")
    msg = str(e.value)
    for op in ("aten.median.dim", "aten.bucketize.Tensor", "aten._fft_r2c.default"):
        assert op in msg
    assert "test_fallback.py" in msg and "drop fallback=" in msg


def test_bad_fallback_mode_and_random_ops_are_refused():
    with pytest.raises(ArgumentError, match="fallback='maybe'"):
        kiln.compile(Unusual().eval(), _args(), fallback="maybe")

    class Noisy(torch.nn.Module):
        def forward(self, x):
            return x + torch.randint_like(x, 0, 3)

    with pytest.raises(UnsupportedOpError, match="draws random numbers"):
        kiln.compile(Noisy(), (torch.randn(3),))


def test_eval_batch_norm_and_upsampling_are_decomposed_not_fallen_back():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                torch.nn.ReLU(), torch.nn.Upsample(scale_factor=2,
                                                                   mode="bilinear"))
    bn = model[1]
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.normal_()
        bn.bias.normal_()
    model.eval()
    x = torch.randn(2, 3, 9, 9)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnWarning)  # nothing may fall back
        for target in ("cpu", "interpret"):
            exe = kiln.compile(model, (x,), target=target)
            torch.testing.assert_close(exe(x), model(x), rtol=1e-5, atol=1e-5)
    ops = {op.target for r in exe.plan.regions for op in r.ops}
    assert not any("batch_norm" in op or "upsample" in op for op in ops), ops
    half = model.half()
    xh = x.half()
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnWarning)
        out = kiln.compile(half, (xh,))(xh)
    ref = half.float()(x)
    assert out.dtype == torch.float16
    assert ((out.float() - ref).norm() / ref.norm()) < 1e-2


def test_a_saved_module_with_fallback_ops_loads_and_runs(tmp_path):
    model = Unusual().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KilnWarning)
        exe = kiln.compile(model, _args())
    exe.save(tmp_path / "m.kiln")
    loaded = kiln.load(tmp_path / "m.kiln")
    args = _args()
    torch.testing.assert_close(loaded(*args), model(*args), rtol=1e-5, atol=1e-5)


MODEL_FILE = '''
import torch
class M(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(x).median(dim=-1).values * 2
def make():
    return M(), (torch.randn(3, 5),)
'''


def test_cli_warns_in_its_own_words_and_refuses_with_fallback_error(tmp_path, capsys):
    from kiln.cli import main

    path = tmp_path / "m.py"
    path.write_text(MODEL_FILE)
    assert main(["run", f"{path}:make"]) == 0
    err = capsys.readouterr().err
    assert "kiln: warning: kiln generates no kernel for aten.median.dim" in err
    assert "use --fallback error" in err and "Traceback" not in err
    assert main(["run", f"{path}:make", "--fallback", "error"]) == 2
    err = capsys.readouterr().err
    assert "kiln: error: kiln cannot compile 1 operation: aten.median.dim" in err
    assert f"{path}:5" in err


@torch.library.custom_op("kiln_test_lib::twice_plus", mutates_args=())
def _twice_plus(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 2 * x + y


@_twice_plus.register_fake
def _(x, y):
    return torch.empty_like(x)


@torch.library.custom_op("kiln_test_lib::bump_", mutates_args=("x",))
def _bump(x: torch.Tensor) -> None:
    x.add_(1)


class LibraryOp(torch.nn.Module):
    """A library's own torch.library op between ops kiln fuses (transformers 5 runs its
    MoE experts through `transformers::grouped_mm_fallback`, one kiln now generates)."""

    def forward(self, x, y):
        return torch.ops.kiln_test_lib.twice_plus(x.sin(), y).cos()


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_a_library_custom_op_runs_as_it_is(target):
    x, y = torch.randn(5, 8), torch.randn(5, 8)
    with pytest.warns(KilnWarning, match="kiln_test_lib.twice_plus.default"):
        exe = kiln.compile(LibraryOp(), (x, y), target=target)
    x, y = torch.randn(5, 8), torch.randn(5, 8)
    torch.testing.assert_close(exe(x, y), LibraryOp()(x, y), rtol=1e-5, atol=1e-5)


def test_a_custom_op_that_writes_its_argument_is_refused():
    class Bumps(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            torch.ops.kiln_test_lib.bump_(y)
            return y

    with pytest.raises(UnsupportedOpError, match="kiln_test_lib.bump_"):
        kiln.compile(Bumps(), (torch.randn(3),))


def test_loading_a_module_whose_custom_op_is_not_registered_says_what_to_import(tmp_path):
    import subprocess
    import sys

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KilnWarning)
        exe = kiln.compile(LibraryOp(), (torch.randn(2, 4), torch.randn(2, 4)))
    exe.save(tmp_path / "m.kiln")
    code = ("import kiln\ntry:\n    kiln.load(r'%s')\nexcept kiln.errors.KilnError as e:\n"
            "    print(type(e).__name__, e)\n" % (tmp_path / "m.kiln"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120).stdout
    assert "ArtifactError" in out and "kiln_test_lib.twice_plus.default" in out
    assert "import the library" in out


class RescalesOnce(torch.nn.Module):
    """Writes its weight in place while running, as RWKV does on its first eval call."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))
        self.rescaled = False

    def forward(self, x):
        if not self.rescaled:
            with torch.no_grad():
                self.w.div_(2)
            self.rescaled = True
        return x * self.w


def test_a_parameter_written_in_forward_is_named_with_what_to_do():
    model = RescalesOnce().eval()
    with pytest.raises(UnsupportedOpError, match=r"writes 1 parameter\(s\) in place \(w\)") as e:
        kiln.compile(model, (torch.randn(4),))
    assert "call it once eagerly" in str(e.value)
    model(torch.randn(4))  # the hint's way out: the first call rescales, the rest do not
    exe = kiln.compile(model, (torch.randn(4),))
    x = torch.randn(4)
    assert torch.allclose(exe(x), model(x))


class StandardizedConv(torch.nn.Conv2d):
    """BiT's weight-standardised conv: the weight normalised per output channel through
    batch norm with no running statistics."""

    def forward(self, x):
        w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None,
                         training=True, momentum=0.0, eps=1e-6).reshape_as(self.weight)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_batch_norm_with_no_statistics_is_decomposed(target):
    model = StandardizedConv(3, 4, 3).eval()
    x = torch.randn(2, 3, 6, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnWarning)  # nothing may fall back
        exe = kiln.compile(model, (x,), target=target)
    with torch.no_grad():
        torch.testing.assert_close(exe(x), model(x), rtol=1e-5, atol=1e-5)
