"""kiln.compile(model) without example args, as torch.compile: compiles on the first call,
once per call signature, warns on each recompile, stops at max_modules; what a
CompiledModule offers is forwarded while there is exactly one (kiln/lazy_module.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

import kiln
import kiln.api
from kiln.errors import (
    ArgumentError,
    DeviceError,
    KilnWarning,
    LazyModuleError,
    RecompileLimitError,
    ShapeError,
)
from kiln.lazy_module import LazyModule


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Two(torch.nn.Module):
    def forward(self, tokens, input_pos):
        return tokens * 2 + input_pos


class Nested(torch.nn.Module):
    def forward(self, x):
        return x + 1, {"double": x * 2, "sum": x.sum(-1)}


class ScaleBy(torch.nn.Module):
    def forward(self, x, n: int):
        return x * n


@pytest.fixture
def compiles(monkeypatch):
    """The targets of the compiles kiln.compile's lazy modules run, in order."""
    seen = []
    real = kiln.api._compile_now

    def counting(model, args, kwargs, *, target, **kw):
        seen.append(target)
        return real(model, args, kwargs, target=target, **kw)

    monkeypatch.setattr(kiln.api, "_compile_now", counting)
    return seen


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def test_first_and_second_call_match_eager_and_compile_once(compiles):
    model = MLP().eval()
    exe = kiln.compile(model)
    assert isinstance(exe, LazyModule) and not compiles
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnWarning)
        for x in (_x(4, 4), _x(4, 4)):
            torch.testing.assert_close(exe(x), model(x))
    assert compiles == ["cpu"] and len(exe.modules) == 1  # the target from the tensors
    assert exe.target.name == "cpu"


def test_a_new_batch_size_compiles_another_module_and_warns_what_changed(compiles):
    model = MLP().eval()
    exe = kiln.compile(model)
    exe(_x(4, 4))
    x6 = _x(6, 4)
    with pytest.warns(KilnWarning, match=r"recompiled \(module 2 of at most 8\): "
                      r"argument 'x' dim 0 is 6, was 4") as seen:
        torch.testing.assert_close(exe(x6), model(x6))
    text = str(seen[0].message)
    assert "dynamic_shapes={'x': {0: kiln.Dim(\"x_0\", min=1, max=LARGEST)}}" in text
    assert seen[0].filename == __file__  # points at the call that recompiled
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnWarning)
        exe(_x(4, 4)), exe(_x(6, 4))  # both kept, by signature
    assert len(compiles) == 2 and len(exe.modules) == 2


def test_a_new_dtype_or_int_value_recompiles_and_says_so(compiles):
    exe = kiln.compile(ScaleBy())
    exe(_x(2, 3), 2)
    with pytest.warns(KilnWarning, match="argument 'n' is 3, was 2.*non-tensor value"):
        assert torch.equal(exe(x := _x(2, 3), 3), x * 3)
    with pytest.warns(KilnWarning, match="argument 'x' dtype is torch.float64, was "
                      "torch.float32"):
        exe(_x(2, 3, dtype=torch.float64), 3)
    assert len(compiles) == 3


def test_bounded_dynamic_shapes_serve_every_size_with_one_module(compiles):
    model = MLP().eval()
    exe = kiln.compile(model, dynamic_shapes={"x": {0: kiln.Dim("batch", min=1, max=16)}})
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnWarning)
        for n in (4, 6, 16, 4):
            torch.testing.assert_close(exe(x := _x(n, 4)), model(x))
    assert len(compiles) == 1
    with pytest.raises(ShapeError, match="outside the bounds declared"):  # as the eager form
        exe(_x(17, 4))
    assert len(exe.modules) == 1


def test_past_max_modules_is_a_kiln_error(compiles):
    exe = kiln.compile(MLP().eval(), max_modules=2)
    assert kiln.compile(MLP()).max_modules == 8  # torch.compile's limit by default
    exe(_x(2, 4))
    with pytest.warns(KilnWarning):
        exe(_x(3, 4))
    with pytest.raises(RecompileLimitError, match="dim 0 is 5, was 3") as err:
        exe(_x(5, 4))
    assert "max_modules=2 modules" in err.value.what and "kiln.Dim" in err.value.hint
    assert "max_modules=N" in err.value.hint and len(compiles) == 2
    exe(_x(2, 4))  # what was compiled still runs


@pytest.mark.parametrize("bad", [0, -1, 2.0, "8"])
def test_max_modules_must_be_a_positive_int(bad):
    with pytest.raises(ArgumentError, match="max_modules= must be a positive int"):
        kiln.compile(MLP(), max_modules=bad)


def test_save_explain_and_attributes_forward_to_the_one_module(tmp_path):
    model = MLP().eval()
    exe = kiln.compile(model)
    for what in ("save", "explain"):
        with pytest.raises(LazyModuleError, match=f"'{what}' needs a compiled module.*"
                           "first call") as err:
            exe.save(tmp_path / "a.kiln") if what == "save" else exe.explain()
        assert "kiln.compile(model, args)" in err.value.hint
    with pytest.raises(LazyModuleError, match="'plan' needs a compiled module"):
        exe.plan  # noqa: B018
    assert not hasattr(exe, "cuda_graphs")  # an AttributeError too
    x = _x(4, 4)
    exe(x)
    only = exe.modules[0]
    assert exe.plan is only.plan and exe.explain() == only.explain()
    exe.save(tmp_path / "a.kiln")
    torch.testing.assert_close(kiln.load(tmp_path / "a.kiln")(x), model(x))
    with pytest.warns(KilnWarning):
        exe(_x(5, 4))
    with pytest.raises(LazyModuleError, match="'save' needs one compiled module, and this "
                       "one holds 2") as err:
        exe.save(tmp_path / "b.kiln")
    assert ".modules[0].save" in err.value.hint
    with pytest.raises(AttributeError):
        exe._private  # noqa: B018


def test_positional_and_keyword_calls_in_any_order_share_one_module(compiles):
    """One call of forward(tokens, input_pos), however it is spelt: one module, no
    recompile warning (torch.compile binds a call to the signature alike)."""
    exe = kiln.compile(Two())
    a, b = _x(2, 3), _x(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnWarning)
        for call in (lambda: exe(a, b), lambda: exe(a, input_pos=b),
                     lambda: exe(tokens=a, input_pos=b), lambda: exe(input_pos=b, tokens=a)):
            assert torch.equal(call(), a * 2 + b)
    assert len(compiles) == 1 and len(exe.modules) == 1


class Scaled(torch.nn.Module):
    def forward(self, x, scale: float = 2.0, bias=None):
        return x * scale if bias is None else x * scale + bias


def test_a_default_passed_or_left_out_shares_one_module(compiles):
    """forward's defaults passed explicitly are the call that leaves them out; a
    dynamic_shapes entry for an argument left out does not stop the compile."""
    exe = kiln.compile(Scaled(), dynamic_shapes={"x": {0: kiln.Dim("batch", max=8)},
                                                 "scale": None})
    x, x5 = _x(3, 4), _x(5, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnWarning)
        for call, arg in ((lambda: exe(x, 2.0), x), (lambda: exe(x), x),
                          (lambda: exe(x, scale=2.0), x), (lambda: exe(x, bias=None), x),
                          (lambda: exe(x=x5, scale=2.0), x5)):
            torch.testing.assert_close(call(), arg * 2)
    assert len(compiles) == 1
    with pytest.warns(KilnWarning, match="recompiled"):  # another value: another module
        torch.testing.assert_close(exe(x, 3.0), x * 3)
    assert len(compiles) == 2


@pytest.mark.parametrize(("call", "named"), [
    (lambda exe, a: exe(a, a, a), "takes 2 positional arguments (tokens, input_pos), got 3"),
    (lambda exe, a: exe(a, a, pos=a), "unexpected keyword argument 'pos'"),
    (lambda exe, a: exe(a), "missing a required argument: 'input_pos'"),
    (lambda exe, a: exe(a, a, tokens=a), "multiple values for argument 'tokens'"),
])
def test_a_call_forward_cannot_take_is_an_argument_error_naming_it(compiles, call, named):
    exe = kiln.compile(Two())
    with pytest.raises(ArgumentError) as err:
        call(exe, _x(2, 3))
    assert named in err.value.what and "Two.forward(tokens, input_pos)" in err.value.what
    assert "kiln.compile(Two)" in err.value.where and "forward(tokens, input_pos)" in \
        err.value.hint
    assert not compiles  # refused before any compile


def test_a_model_returning_a_tuple_and_a_dict():
    model = Nested()
    exe = kiln.compile(model)
    x = _x(2, 5)
    got, want = exe(x), model(x)
    assert isinstance(got, tuple) and isinstance(got[1], dict)
    torch.testing.assert_close(got, want)


def test_a_given_target_is_used_and_mixed_devices_are_refused(compiles):
    exe = kiln.compile(MLP().eval(), target="cpu")
    exe(_x(2, 4))
    assert compiles == ["cpu"]
    with pytest.raises(DeviceError, match="several kinds of device.*'tokens' on cpu.*"
                       "'input_pos' on meta"):
        kiln.compile(Two())(_x(2, 3), _x(2, 3).to("meta"))


@pytest.mark.parametrize("kw", [{"compile_to": "graph"}, {"dump_ir": "/tmp/ir"}])
def test_compile_to_and_dump_ir_need_example_args(kw):
    name = next(iter(kw))
    with pytest.raises(ArgumentError, match=f"{name}= needs example args") as err:
        kiln.compile(MLP(), **kw)
    assert f"kiln.compile(model, args, {name}=...)" in err.value.hint


def test_the_lazy_forms_mistakes_are_found_at_compile():
    with pytest.raises(ArgumentError, match="unknown option"):
        kiln.compile(MLP(), options={"tunes": "none"})
    with pytest.raises(ArgumentError, match="fallback="):
        kiln.compile(MLP(), fallback="maybe")
    with pytest.raises(ArgumentError, match="max_modules= bounds"):
        kiln.compile(MLP(), (_x(2, 4),), max_modules=3)


def test_no_args_is_no_longer_a_type_error():
    """kiln.compile(model) used to raise TypeError: missing 1 required positional 'args'."""
    for exe in (kiln.compile(MLP()), kiln.compile(MLP(), None), kiln.compile(MLP(), args=None)):
        assert isinstance(exe, LazyModule)


def test_eager_forms_keep_working():
    model, x = MLP().eval(), _x(3, 4)
    for exe in (kiln.compile(model, x), kiln.compile(model, args=(x,)),
                kiln.compile(Two(), kwargs={"tokens": x, "input_pos": x})):
        assert isinstance(exe, kiln.CompiledModule)
    torch.testing.assert_close(kiln.compile(model, x)(x), model(x))
