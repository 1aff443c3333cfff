"""Compile-time errors: each a KilnError subclass saying what, where (the user's line), how.

Call-time checks (sizes outside bounds, dtypes, argument counts) are in
tests/runtime/test_guards.py; unreadable artifacts in tests/artifact/test_bad_artifacts.py.
"""

import inspect

import pytest
import torch

import kiln
from kiln.errors import (
    ArgumentError,
    ArtifactError,
    ExportError,
    KilnError,
    KilnWarning,
    ShapeError,
    TargetError,
    UnsupportedOpError,
    user_frame,
)

HERE = __file__.rsplit("/", 1)[-1]


def _line_of(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _where(e: KilnError) -> str:
    assert e.where, f"no source line in: {e}"
    return e.where


class NonZero(torch.nn.Module):
    def forward(self, x):
        idx = torch.nonzero(x > 0)
        return idx * 2


class BoolMask(torch.nn.Module):
    def forward(self, x):
        return x[x > 0] + 1


class Erfinv(torch.nn.Module):
    def forward(self, x):
        y = x * 0.5
        return torch.special.erfinv(y) + 1


class BoolMaskReshaped(torch.nn.Module):
    def forward(self, x):
        return x[x > 0].reshape(2, 3)  # export pins the size to 6 with run-time asserts


@pytest.mark.parametrize("model,op,line", [
    (NonZero, "aten.nonzero.default", "torch.nonzero(x > 0)"),
    (BoolMask, "aten.index.Tensor", "x[x > 0]"),
    (BoolMaskReshaped, "aten.index.Tensor", "x[x > 0]"),
])
def test_data_dependent_size_names_the_op_and_line(model, op, line):
    with pytest.raises(UnsupportedOpError) as e:
        kiln.compile(model(), (torch.randn(4, 3),))
    assert op in e.value.what and "depends on its data" in e.value.what
    assert f"{HERE}:{_line_of(model.forward, line)}" in _where(e.value)
    assert line in e.value.where
    assert "torch.where" in e.value.hint


class SplitByCounts(torch.nn.Module):
    """An MoE's experts split by counts read from the data (JetMoe's, in transformers)."""

    def forward(self, x, counts):
        parts = torch.split(x, counts.tolist())
        return torch.cat([p * (i + 1) for i, p in enumerate(parts)])


class RoutedBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = SplitByCounts()

    def forward(self, x, counts):
        return self.experts(x, counts) + 1


def test_a_split_by_sizes_read_from_data_names_the_split_not_its_item(monkeypatch):
    args = (torch.randn(6, 4), torch.tensor([2, 4]))
    with pytest.raises(UnsupportedOpError) as e:
        kiln.compile(RoutedBlock(), args)
    assert e.value.what.startswith("aten.split_with_sizes.default produces a tensor")
    assert "torch.split(x, counts.tolist())" in e.value.where
    assert ".tolist()" in e.value.hint
    # library code (no user line, as transformers' JetMoe): the module it ran in
    from kiln.frontend import export

    monkeypatch.setattr(export, "where", lambda node: None)
    with pytest.raises(UnsupportedOpError) as e:
        kiln.compile(RoutedBlock(), args)
    assert e.value.where == "module model.experts"


def test_op_kiln_does_not_know_names_the_op_and_line():
    with pytest.raises(UnsupportedOpError) as e:
        kiln.compile(Erfinv(), (torch.rand(4),), fallback="error")
    assert "aten.erfinv.default" in e.value.what
    assert f"{HERE}:{_line_of(Erfinv.forward, 'erfinv(y)')}" in _where(e.value)
    assert e.value.hint.startswith("drop fallback=")
    with pytest.warns(KilnWarning, match="aten.erfinv.default") as w:
        kiln.compile(Erfinv(), (torch.rand(4),))  # by default it runs as PyTorch's op
    assert f"{HERE}:{_line_of(Erfinv.forward, 'erfinv(y)')}" in str(w[0].message)


class Branchy(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


class ItemSized(torch.nn.Module):
    def forward(self, x):
        return torch.zeros(int(x.max().item()))


@pytest.mark.parametrize("model,line", [(Branchy, "if x.sum() > 0"),
                                        (ItemSized, "x.max().item()")])
def test_export_failure_carries_torchs_explanation(model, line, capfd):
    with pytest.raises(ExportError) as e:
        kiln.compile(model(), (torch.randn(3),))
    assert "data-dependent" in e.value.what
    assert f"{HERE}:{_line_of(model.forward, line)}" in _where(e.value)
    assert "torch said:" in e.value.hint and "data-dependent expression" in e.value.hint
    assert "def forward" not in capfd.readouterr().err  # torch's partial graph is not dumped


def test_a_data_dependent_guard_in_library_code_names_torchs_cause(monkeypatch):
    """With no frame of the user's (transformers' BioGpt under a dynamic length: its
    mask helper guards on a data-dependent size), the library line torch names."""
    from kiln.frontend import export

    monkeypatch.setattr(export, "user_frame", lambda text: None)
    with pytest.raises(ExportError) as e:
        kiln.compile(Branchy(), (torch.randn(3),))
    # torch names its own line here (SwitchTransformers' `for e in mask.nonzero()` was
    # placed at "_refs/__init__.py in unbind"): not a line to show as the model's
    assert "_export/" not in e.value.where and "library code" not in e.value.where
    assert export._caused_by("Caused by: (_refs/__init__.py:4264 in unbind)") is None
    assert export._caused_by("x\nCaused by: (transformers/masking_utils.py:229 in "
                             "prepare_padding_mask)\n") == (
        "transformers/masking_utils.py:229 in prepare_padding_mask "
        "(library code the model calls)")


def test_library_frame_is_the_innermost_transformers_line():
    """Where no frame is the user's (transformers' OPT slicing its positions by a cached
    length read from data), the transformers line, not torch's message."""
    transformers = pytest.importorskip("transformers")
    from kiln.errors import library_frame

    root = transformers.__path__[0]
    tb = (f'  File "/home/me/run.py", line 3, in <module>\n    kiln.compile(m, ())\n'
          f'  File "{root}/models/opt/modeling_opt.py", line 361, in forward\n'
          "    position_ids = position_ids[:, past_seen_tokens:]\n"
          f'  File "{torch.__path__[0]}/_tensor.py", line 10, in __index__\n    x\n')
    assert library_frame(tb) == (f"{root}/models/opt/modeling_opt.py:361 in forward: "
                                 "position_ids = position_ids[:, past_seen_tokens:]")
    assert library_frame('  File "/home/me/run.py", line 3, in <module>\n') is None


class ChecksItsArguments(torch.nn.Module):
    """Raises by itself, as transformers' Bamba does with its default config (its cache
    has no attention layer to ask for a length): eager PyTorch raises the same."""

    def forward(self, x, mode="fast"):
        if mode not in ("slow",):
            raise ValueError(f"mode {mode!r} needs a cache this model does not have")
        return x * 2


def test_an_error_the_model_raises_itself_is_called_the_models():
    with pytest.raises(ValueError):
        ChecksItsArguments()(torch.randn(3))
    with pytest.raises(ExportError) as e:
        kiln.compile(ChecksItsArguments(), (torch.randn(3),))
    assert "the model's own code raised ValueError" in e.value.what
    assert "needs a cache this model does not have" in e.value.what
    assert f"{HERE}:{_line_of(ChecksItsArguments.forward, 'raise ValueError')}" in _where(e.value)
    assert "model(*args, **kwargs)" in e.value.hint and "data-dependent" not in e.value.hint
    assert "another path while traced" in e.value.hint  # runs eagerly: what to pass
    exe = kiln.compile(ChecksItsArguments(), (torch.randn(3),), {"mode": "slow"})
    x = torch.randn(3)
    assert torch.equal(exe(x, mode="slow"), x * 2)


class Reshaper(torch.nn.Module):
    def forward(self, x):
        return x.view(4, 2) * 2


class Add(torch.nn.Module):
    def forward(self, x, y):
        return x + y


def test_dynamic_dim_the_model_specialises():
    with pytest.raises(ShapeError) as e:
        kiln.compile(Reshaper(), (torch.randn(4, 2),),
                     dynamic_shapes=({0: kiln.Dim("B", min=2, max=8)},))
    assert "do not hold" in e.value.what
    assert "B = 4" in e.value.hint  # torch's suggested fix


def test_a_dynamic_dim_whose_example_is_1_says_to_give_a_larger_example():
    """torch.export fixes a dim whose example size is 0 or 1 ("specialized it to be a
    constant (1)"): the error says so, and the larger example works, size 1 included."""
    dims = ({1: kiln.Dim("T", min=1, max=64)},)
    with pytest.raises(ShapeError) as e:
        kiln.compile(Add(), (torch.randn(2, 1), torch.randn(2, 1)), dynamic_shapes=dims * 2)
    assert "T was fixed to 1" in e.value.what and "at least 2" in e.value.hint
    exe = kiln.compile(Add(), (torch.randn(2, 2), torch.randn(2, 2)), dynamic_shapes=dims * 2)
    x = torch.randn(2, 1)
    assert torch.equal(exe(x, x), x + x)


def test_dynamic_shapes_of_the_wrong_structure():
    x = torch.randn(4, 2)
    with pytest.raises(ShapeError, match="does not match the model's arguments") as e:
        kiln.compile(Add(), (x, x), dynamic_shapes=({0: kiln.Dim("B")},))
    assert "2 elements" in e.value.where and "one entry per argument" in e.value.hint


class Flagged(torch.nn.Module):
    def forward(self, x, scale=True):
        return x * 2 if scale else x


@pytest.mark.parametrize("kwargs,spec", [
    ({"scale": False}, ({0: kiln.Dim("B")}, {"scale": None})),  # a dict where None goes
    ({}, {"x": {0: kiln.Dim("B")}, "scale": {0: kiln.Dim("B")}}),
])
def test_dynamic_dims_given_to_a_non_tensor_argument(kwargs, spec):
    """torch.export said 'expected dynamic_shape to be None, int, or _DimHint for
    _IntWrapper, got dict', which kiln passed on as the model not being capturable."""
    x = torch.randn(4, 2)
    args = (x,) if kwargs else (x, True)
    with pytest.raises(ShapeError, match=r"gives (argument 1|scale) \(bool (False|True)\) "
                       r"dims .*only a tensor has dims") as e:
        kiln.compile(Flagged(), args, kwargs, dynamic_shapes=spec)
    assert "give None for it" in e.value.hint


class StartPos(torch.nn.Module):
    """Meta's Llama writes its KV cache at an int `start_pos`: cache[:, start:start + T]."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 16, 4))

    def forward(self, x, start_pos):
        start = start_pos if isinstance(start_pos, int | torch.SymInt) else start_pos[0]
        self.cache[:, start:start + x.shape[1]] = x
        return self.cache[:, :start + x.shape[1]].sum(1)


@pytest.mark.parametrize("start,spec", [
    (3, (None, torch.export.Dim.DYNAMIC)),
    (3, {"x": None, "start_pos": torch.export.Dim.AUTO}),
    ((3, 0), (None, (torch.export.Dim.DYNAMIC, None))),  # seen only after export
])
def test_an_int_argument_made_dynamic_is_a_size(start, spec):
    """A dynamic int was refused (kiln read sizes from tensor dims only; before that it
    reached region formation as an unknown value, a VerifierError): it is now a size
    symbol bound from the argument on every call (frontend/int_args.py)."""
    exe = kiln.compile(StartPos(), (torch.randn(1, 1, 4), start), dynamic_shapes=spec,
                       target="cpu")
    ref = StartPos()
    for pos in (0, 5, 15):
        x = torch.randn(1, 1, 4)
        arg = pos if isinstance(start, int) else (pos, 0)
        torch.testing.assert_close(exe(x, arg), ref(x, arg))
    with pytest.raises(ShapeError, match=r"start_pos"):
        exe(torch.randn(1, 1, 4), 16 if isinstance(start, int) else (16, 0))


def test_a_float_argument_made_dynamic_is_refused():
    class Scaled(torch.nn.Module):
        def forward(self, x, scale: float):
            return x * scale

    with pytest.raises(ShapeError, match=r"\(a Python float\) dynamic") as e:
        kiln.compile(Scaled(), (torch.randn(2), 2.0),
                     dynamic_shapes=(None, torch.export.Dim.DYNAMIC))
    assert "give None for it" in e.value.hint


class Misfit(torch.nn.Module):
    """A config whose sizes disagree, as transformers' CodeGen with rotary_dim 64 over
    16-wide heads: it fails run eagerly too."""

    def __init__(self, how):
        super().__init__()
        self.how, self.proj = how, torch.nn.Linear(4, 8)

    def forward(self, x):
        if self.how == "broadcast":
            return x * torch.ones(x.shape[0], 3)
        if self.how == "matmul":
            return self.proj(x)
        if self.how == "cat":  # LongT5's position bias with no attention_mask, traced
            return torch.cat([x, torch.ones(1, 3)], -1)
        return x.view(x.shape[0], 5, -1, 7)


@pytest.mark.parametrize("how,said", [("broadcast", "broadcast a dimension of length 3"),
                                      ("matmul", "must have same reduction dim"),
                                      ("view", "is invalid for input of size"),
                                      ("cat", "Sizes of tensors must match")])
def test_an_op_whose_operands_do_not_fit_is_the_models_error(how, said, caplog):
    x = torch.randn(2, 6)
    with pytest.raises(ExportError, match="operands whose shapes do not fit") as e:
        kiln.compile(Misfit(how), (x,))
    assert said in str(e.value) and "test_errors.py" in e.value.where
    assert "if model(*args, **kwargs) fails the same way" in e.value.hint
    assert "torch.export traces it" in e.value.hint and "data-dependent" not in e.value.hint
    # torch's fake tensors logged the failing op's whole traceback before kiln's error
    assert not [r for r in caplog.records if r.name == "torch._subclasses.fake_tensor"]


def test_a_transformers_config_whose_sizes_disagree_is_named_at_the_library_line():
    """GPT-J with a rotary dim (default 64) over 16-wide heads fails eagerly too: the
    error points at transformers' line, where the sizes meet."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPTJConfig(n_embd=64, n_layer=1, n_head=4, vocab_size=100)
    model = transformers.GPTJForCausalLM(cfg).eval()
    with pytest.raises(ExportError, match="operands whose shapes do not fit") as e:
        kiln.compile(model, (), {"input_ids": torch.randint(0, 100, (1, 5)),
                                 "use_cache": False})
    assert "modeling_gptj.py" in e.value.where


class Counted:
    """A length kept in a tensor on a plain object, as transformers' static cache keeps
    the tokens it has seen (get_seq_length() returns it)."""

    def __init__(self):
        self.seen = torch.tensor(0)


class LengthFromData(torch.nn.Module):
    """MPT's ALiBi slice: a bias sliced by a length read from data, added to activations
    of a dynamic length: torch cannot show the two sizes equal."""

    def __init__(self):
        super().__init__()
        self.cache = Counted()
        self.register_buffer("bias", torch.randn(1, 16))

    def forward(self, x):
        length = x.shape[0] + self.cache.seen
        bias = self.bias[max(0, self.bias.size(0) - length):]
        return x + bias


def test_a_data_dependent_size_meeting_another_is_named_at_its_line():
    with pytest.raises(ExportError, match="data-dependent") as e:
        kiln.compile(LengthFromData(), (torch.randn(3, 16),),
                     dynamic_shapes=({0: kiln.Dim("T", min=1, max=8)},))
    if "torch calls that size u" not in str(e.value):  # torch 2.11 stops at the slice
        assert f"{HERE}:{_line_of(LengthFromData.forward, 'self.bias[max(')}" in \
            _where(e.value)
        return
    assert f"{HERE}:{_line_of(LengthFromData.forward, 'x + bias')}" in _where(e.value)
    assert "from shapes" in e.value.hint and "must match the size" in e.value.hint


def test_mpt_under_a_dynamic_length_is_named_at_transformers_line():
    """transformers' MPT through its static-cache export recipe, the sequence dim dynamic:
    its ALiBi slice is bounded by the cache's length, a tensor."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    cfg = transformers.MptConfig(d_model=32, n_heads=4, n_layers=1, vocab_size=64,
                                 max_seq_len=32)
    model = transformers.MptForCausalLM(cfg).eval()
    model.generation_config = transformers.GenerationConfig(
        use_cache=True, cache_implementation="static", max_length=16,
        cache_config={"batch_size": 1, "max_cache_len": 16})
    wrapped = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=16)
    length = kiln.Dim("T", min=1, max=8)
    with pytest.raises(ExportError, match="data-dependent") as e:
        kiln.compile(wrapped, (), {"input_ids": torch.tensor([[1, 2, 3]]),
                                   "cache_position": torch.arange(3)},
                     dynamic_shapes={"input_ids": {1: length}, "cache_position": {0: length}})
    assert "modeling_mpt.py" in e.value.where and "position_bias" in e.value.where


class Pair(torch.nn.Module):
    def forward(self, xs):
        return xs[0] * xs[1]


def test_dynamic_dims_given_to_a_number_inside_a_list():
    """Nested, where kiln's check does not look: torch's own message, as a shape error."""
    x = torch.randn(4, 2)
    with pytest.raises(ShapeError, match="does not match the model's arguments") as e:
        kiln.compile(Pair(), ([x, 3],), dynamic_shapes=([{0: kiln.Dim("B")}, {0: kiln.Dim("B")}],))
    assert "_IntWrapper" in e.value.where and "one entry per argument" in e.value.hint


@pytest.mark.parametrize("spec", [({5: kiln.Dim("B")}, None), {"x": {2: kiln.Dim("B")}}])
def test_dynamic_dim_on_an_axis_the_tensor_lacks(spec):
    x = torch.randn(4, 2)
    with pytest.raises(ShapeError, match=r"marks dim (5|2) of (argument 0|x), which has 2 dims"):
        kiln.compile(Add(), (x, x), dynamic_shapes=spec)


def test_example_size_outside_declared_bounds():
    x = torch.randn(4, 2)
    B = kiln.Dim("B", min=5, max=8)
    with pytest.raises(ShapeError, match=r"outside the bounds.*4 not in range \[5, 8\]"):
        kiln.compile(Add(), (x, x), dynamic_shapes=({0: B}, {0: B}))


def test_not_a_module():
    with pytest.raises(ExportError, match="takes a torch.nn.Module, got function"):
        kiln.compile(lambda x: x, (torch.randn(2),))


def test_unknown_target_and_stage():
    with pytest.raises(TargetError, match="unknown target 'tpu'") as e:
        kiln.compile(Add(), (torch.randn(2), torch.randn(2)), target="tpu")
    assert "cuda:sm_90" in e.value.hint
    with pytest.raises(KilnError, match="unknown stage 'lower'"):
        kiln.compile(Add(), (torch.randn(2), torch.randn(2)), compile_to="lower")


def test_target_that_is_not_a_string():
    with pytest.raises(TargetError, match="named by a string, got int 90"):
        kiln.compile(Add(), (torch.randn(2), torch.randn(2)), target=90)


@pytest.mark.parametrize("options,message,hint", [
    (["tune", "none"], "options= must be a dict, got list", "options={'tune'"),
    ({"tunee": "none"}, "unknown option 'tunee'", "did you mean 'tune'?"),
    ({"fallback": "error"}, "unknown option 'fallback'", "kiln.compile(..., fallback=...)"),
    ({"tune": "fastest"}, "options['tune'] is 'fastest', not one of none, fast, full", None),
    ({"tune_timeout": "60"}, "positive number of seconds, got '60'", None),
    ({"tune_workers": 0}, "tune_workers'] must be a positive int, got 0", None),
    ({"mask_envelope": 1}, "options['mask_envelope'] must be True or False, got 1",
     "every key block"),
    ({"query_prologue_split": "no"}, "options['query_prologue_split'] must be True or False",
     "query prologue"),
    ({"key_prologue_split": 0}, "options['key_prologue_split'] must be True or False",
     "key and value prologues"),
])
def test_bad_options_name_the_option(options, message, hint):
    with pytest.raises(ArgumentError) as e:
        kiln.compile(Add(), (torch.randn(2), torch.randn(2)), options=options)
    assert message in e.value.what
    assert hint is None or hint in e.value.hint


@pytest.mark.parametrize("kwargs", [[torch.randn(4, 3)], {1: torch.randn(2)}, "y"])
def test_kwargs_that_are_not_a_dict_of_names(kwargs):
    with pytest.raises(ArgumentError, match="kwargs must be a dict"):
        kiln.compile(Add(), (torch.randn(2),), kwargs)


def test_the_models_keyword_passed_to_compile_says_to_use_kwargs():
    """As torch.export: the model's keyword arguments go in `kwargs`, not compile's own."""
    x = torch.randn(2)
    with pytest.raises(ArgumentError) as e:
        kiln.compile(Add(), (x,), y=x, use_cache=False)
    assert "does not take: y, use_cache" in e.value.what
    assert "kwargs={'y': ..., 'use_cache': False}" in e.value.hint
    with pytest.raises(ArgumentError) as e:
        kiln.compile(Add(), (x, x), taget="cpu")
    assert "did you mean target?" in e.value.hint
    with pytest.raises(ArgumentError):  # the lazy form too, before anything compiles
        kiln.compile(Add(), use_cache=False)


def test_dump_ir_that_cannot_be_a_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    x = torch.randn(2)
    with pytest.raises(KilnError, match="cannot write IR dumps to .*a file is in the way"):
        kiln.compile(Add(), (x, x), dump_ir=tmp_path / "f")
    with pytest.raises(ArgumentError, match="dump_ir= must be a directory path, got int"):
        kiln.compile(Add(), (x, x), dump_ir=3)


class Lin(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.proj(x)


@pytest.mark.parametrize("kw,message", [
    ({"device_map": [1]}, "device_map= must map device indices to device indices"),
    ({"device_map": {"a": 0}}, "device_map= must map device indices to device indices"),
    ({"pins": ["proj.weight"]}, "pins= must map state names to device indices"),
    ({"pins": {"proj.weight": "cuda:1"}}, "pins= must map state names to device indices"),
    ({"pins": {"proj.weihgt": 0}}, "pins names 'proj.weihgt', which is not a weight"),
])
def test_bad_device_map_and_pins(kw, message):
    with pytest.raises(ArgumentError) as e:
        kiln.compile(Lin(), (torch.randn(2, 4),), **kw)
    assert message in e.value.what
    if "weihgt" in message:
        assert "did you mean 'proj.weight'?" in e.value.hint


def test_pins_may_name_a_weight_another_pipeline_stage_holds():
    from kiln.models.llama import example_inputs, tiny_llama

    model = tiny_llama()
    args, ds = example_inputs(model.cfg)
    kg = kiln.compile(model, args, dynamic_shapes=ds, compile_to="parallel", devices=2,
                      parallel={"pp": 2, "rank": 1}, pins={"model.embed_tokens.weight": 0})
    assert "model.embed_tokens.weight" not in kg.state  # stage 0's, still a valid pin


def test_unreadable_artifact_is_a_kiln_error(tmp_path):
    (tmp_path / "m.kiln").mkdir()
    with pytest.raises(ArtifactError) as e:
        kiln.load(tmp_path / "m.kiln")
    assert isinstance(e.value, KilnError)
    assert "m.kiln" in e.value.what and "kiln compile" in e.value.hint


def test_user_frame_ignores_library_frames_not_folder_names():
    trace = (
        'File "/home/u/kiln/models/mine.py", line 12, in forward\n'
        "    y = self.proj(x)\n"
        f'  File "{torch.__file__}", line 3, in inner\n'
        "    return thing\n"
        f'  File "{kiln.__file__}", line 9, in helper\n'
        "    pass\n"
    )
    assert user_frame(trace) == "/home/u/kiln/models/mine.py:12 in forward: y = self.proj(x)"
    assert user_frame(None) is None


class SizeRatio(torch.nn.Module):
    def forward(self, x):
        return x * (x.shape[1] / 4)  # a float from a dynamic size (ViT's interpolation scale)


def test_a_float_from_a_dynamic_size_is_refused_with_its_line():
    with pytest.raises(UnsupportedOpError) as e:
        kiln.compile(SizeRatio(), (torch.randn(2, 8),),
                     dynamic_shapes=({1: kiln.Dim("n", min=2, max=64)},))
    assert "a float computed from a dynamic size" in e.value.what
    assert "x.shape[1] / 4" in e.value.where and "static" in e.value.hint


class SpectrumOf(torch.nn.Module):
    def forward(self, x):
        return torch.fft.rfft(x, dim=-1).abs()  # no bf16 kernel (Autoformer's in bf16)


def test_an_op_that_fails_for_its_dtype_names_the_models_line():
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        SpectrumOf()(x)  # eager fails the same way
    with pytest.raises(ExportError) as e:
        kiln.compile(SpectrumOf(), (x,))
    assert f"{HERE}:{_line_of(SpectrumOf.forward, 'torch.fft.rfft')}" in _where(e.value)
    assert "raises the same error eagerly" in e.value.hint
