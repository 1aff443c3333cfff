"""Dynamic Python int arguments (frontend/int_args.py): an int given a Dim is a size
symbol bound from the argument at call time, so Meta's Llama (`forward(tokens,
start_pos: int)`, its KV cache in plain tensor attributes) prefills and decodes as one
compiled module; a value outside its Dim, or one the model's slices cannot take, is a
ShapeError naming the argument."""

from __future__ import annotations

import copy

import pytest
import torch

import kiln
from kiln.errors import ArgumentError, ShapeError
from tests.frontend.meta_llama import ModelArgs, Transformer


class Head(torch.nn.Module):
    def forward(self, x, n: int):
        return x[:, :n] * 2


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_an_int_argument_slices_by_its_value_on_every_call(target):
    exe = kiln.compile(Head(), (torch.randn(2, 8), 3),
                       dynamic_shapes={"x": None, "n": kiln.Dim("n", min=1, max=8)},
                       target=target)
    for n in (1, 2, 5, 8):
        x = torch.randn(2, 8)
        got = exe(x, n)
        assert got.shape == (2, n) and torch.equal(got, x[:, :n] * 2)
    with pytest.raises(ShapeError) as e:
        exe(torch.randn(2, 8), 9)
    assert "argument 'n' is 9" in e.value.what and '"n"' in e.value.what
    assert "[1, 8]" in e.value.what and e.value.where == "argument 'n'"
    with pytest.raises(ArgumentError, match="argument 'n' must be a Python int"):
        exe(torch.randn(2, 8), 3.0)


def test_a_guard_the_model_needs_beyond_the_dims_bounds_is_checked():
    """The Dim allows 12, but x has 8 columns: torch assumed n <= 8 for the slice."""
    exe = kiln.compile(Head(), (torch.randn(2, 8), 3),
                       dynamic_shapes={"x": None, "n": kiln.Dim("n", min=1, max=12)},
                       target="cpu")
    assert torch.equal(exe(torch.ones(2, 8), 8), torch.full((2, 8), 2.0))
    with pytest.raises(ShapeError, match=r"needs: n <= 8 \(dim \"n\""):
        exe(torch.randn(2, 8), 10)
    assert "every call: s" in exe.explain() and "argument 'n'" in exe.explain()


def _meta(seed: int = 0) -> tuple[Transformer, Transformer]:
    torch.manual_seed(seed)
    model = Transformer(ModelArgs()).eval()
    return model, copy.deepcopy(model)  # the reference keeps a cache of its own


_SHAPES = {"tokens": {1: kiln.Dim("seq", max=16)}, "start_pos": kiln.Dim("start", max=15)}


def _steps():
    gen = torch.Generator().manual_seed(1)
    steps = [(torch.randint(0, 64, (1, 5), generator=gen), 0)]
    return steps + [(torch.randint(0, 64, (1, 1), generator=gen), p) for p in (5, 6, 7)]


def _run(exe, ref, steps=None):
    for tokens, pos in steps or _steps():
        got, want = exe(tokens, pos), ref(tokens, pos)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < 1e-5, pos


@pytest.fixture(scope="module")
def meta_cpu():
    model, ref = _meta()
    # an example start of 2: torch.export fixes an int whose example is 0 or 1
    exe = kiln.compile(model, (torch.randint(0, 64, (1, 5)), 2), dynamic_shapes=_SHAPES,
                       target="cpu")
    return model, ref, exe


def test_meta_llama_prefills_and_decodes_as_one_module(meta_cpu):
    """Prefill of 5 tokens at 0, then one token at 5, 6, 7, against eager PyTorch."""
    model, ref, exe = meta_cpu
    for layer in model.layers:  # the model's own attributes stay plain tensors
        assert "cache_k" in vars(layer.attention) and "cache_k" not in layer.attention._buffers
    _run(exe, ref)


def test_a_saved_meta_llama_loads_and_runs_the_same(meta_cpu, tmp_path):
    _, _, exe = meta_cpu
    exe.save(tmp_path / "meta")
    loaded = kiln.load(tmp_path / "meta")
    assert loaded.plan.size_args == exe.plan.size_args
    assert [(str(d), r) for d, r, _ in loaded.plan.size_checks] == \
        [(str(d), r) for d, r, _ in exe.plan.size_checks]
    _, ref = _meta()
    _run(loaded, ref)  # a loaded cache starts at zeros: prefill again
    with pytest.raises(ShapeError, match="argument 'start_pos' is 16"):
        loaded(torch.zeros(1, 1, dtype=torch.long), 16)


def test_start_pos_beyond_its_dim_or_the_cache_is_refused_by_name(meta_cpu):
    _, _, exe = meta_cpu
    with pytest.raises(ShapeError) as e:
        exe(torch.zeros(1, 1, dtype=torch.long), 16)
    assert "argument 'start_pos' is 16" in e.value.what and 'dim "start"' in e.value.what
    assert e.value.where == "argument 'start_pos'" and "Dim(min=, max=)" in e.value.hint
    with pytest.raises(ShapeError) as e:  # 14 + 3 > the cache's 16 rows
        exe(torch.zeros(1, 3, dtype=torch.long), 14)
    assert "<= 16" in e.value.what and 'dim "seq"' in e.value.what
    assert "'start_pos' = 14" in e.value.where


def test_cuda_graphs_refuse_a_module_sized_by_an_int(meta_cpu):
    _, _, exe = meta_cpu
    with pytest.raises(ArgumentError) as e:
        exe.cuda_graphs()
    assert "'start_pos'" in e.value.what and "tensor" in e.value.hint


def test_meta_llama_on_generated_kernels():
    model, ref = _meta(seed=3)
    exe = kiln.compile(model, (torch.randint(0, 64, (1, 3)), 2), dynamic_shapes=_SHAPES,
                       target="interpret")
    gen = torch.Generator().manual_seed(2)
    _run(exe, ref, [(torch.randint(0, 64, (1, 3), generator=gen), 0),
                    (torch.randint(0, 64, (1, 1), generator=gen), 3)])


def test_an_example_of_zero_is_refused_with_what_to_do():
    with pytest.raises(ShapeError) as e:
        kiln.compile(_meta()[0], (torch.randint(0, 64, (1, 5)), 0), dynamic_shapes=_SHAPES,
                     target="cpu")
    assert "fixed it to the example's 0" in e.value.what and "at least 2" in e.value.hint


@pytest.mark.gpu
def test_meta_llama_on_the_gpu_prefills_and_decodes_as_one_module():
    """Built on the GPU as Meta's code is (its caches made on the default device)."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(ModelArgs()).eval()
    ref = copy.deepcopy(model)
    exe = kiln.compile(model, (torch.randint(0, 64, (1, 5), device="cuda"), 2),
                       dynamic_shapes=_SHAPES, target="cuda")
    for tokens, pos in _steps():
        got, want = exe(tokens.cuda(), pos), ref(tokens.cuda(), pos)
        assert got.shape == want.shape
        assert ((got - want).norm() / want.norm()).item() < 1e-4, pos  # fp32, tf32 aside


class AtLeastOne(torch.nn.Module):
    """`max(start, 1)` is `Max(1, s)` over an int that may be 0: a symbol made positive
    would simplify it to `s`, a size of 0 where eager gives 1."""

    def forward(self, x, start: int):
        return torch.ones(max(start, 1), 4) * x[:, start:start + 4].sum(0)


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_a_loaded_module_takes_an_int_of_zero_as_the_compiled_one_does(target, tmp_path):
    x = torch.randn(2, 16)
    exe = kiln.compile(AtLeastOne(), (x, 3), target=target,
                       dynamic_shapes={"x": None, "start": kiln.Dim("start", min=0, max=12)})
    exe.save(tmp_path / "m")
    loaded = kiln.load(tmp_path / "m")
    assert [v.shape for v in loaded.plan.values.values()] == \
        [v.shape for v in exe.plan.values.values()]
    for start in (0, 1, 5):
        want = AtLeastOne()(x, start)
        for module in (exe, loaded):
            got = module(x, start)
            assert got.shape == want.shape and torch.allclose(got, want), (module, start)
