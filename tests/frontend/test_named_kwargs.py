"""Keyword arguments that land in a forward's **kwargs take dynamic_shapes by their own
names or torch's "kwargs" entry (frontend/named_kwargs.py: torch.export alone failed
both ways); the model's forward is its own again afterwards, failed compile or not."""

import warnings

import pytest
import torch

import kiln
from kiln.errors import KilnError, KilnWarning
from tests.helpers import rel_err

transformers = pytest.importorskip("transformers")


class Gathers(torch.nn.Module):
    """A tensor and a flag through **kwargs, as transformers models take them."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x, **kwargs):
        y = self.proj(x) + kwargs["bias"]
        return y * 2 if kwargs.get("double") else y


T = kiln.Dim("T", min=2, max=16)


@pytest.mark.parametrize("spec", [
    {"x": {0: T}, "bias": {0: T}, "double": None},
    {"x": {0: T}, "kwargs": {"bias": {0: T}, "double": None}},
])
def test_kwargs_gathered_by_the_forward_take_dynamic_dims(spec):
    m = Gathers().eval()
    ex = {"x": torch.randn(3, 4), "bias": torch.randn(3, 4), "double": True}
    exe = kiln.compile(m, (), ex, dynamic_shapes=spec)
    assert "forward" not in m.__dict__  # the class's forward again
    for t in (5, 11):
        x, b = torch.randn(t, 4), torch.randn(t, 4)
        with torch.no_grad():
            assert rel_err(exe(x=x, bias=b, double=True), m(x, bias=b, double=True)) <= 1e-6


def test_a_failed_compile_leaves_the_forward_as_it_was():
    m = Gathers().eval()
    ex = {"x": torch.randn(3, 4), "bias": torch.randn(3, 5), "double": False}  # misfit
    with pytest.raises(KilnError):
        kiln.compile(m, (), ex, dynamic_shapes={"x": {0: T}, "bias": {0: T}, "double": None})
    assert "forward" not in m.__dict__


def test_a_transformers_model_taking_use_cache_through_kwargs():
    """GraniteMoe's forward takes use_cache in **kwargs: with a dynamic length torch.export
    raised 'Must provide a tree_name when there might be a mismatch'."""
    cfg = transformers.GraniteMoeConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.GraniteMoeForCausalLM(cfg).eval()
    seq = kiln.Dim("seq", min=2, max=32)
    with warnings.catch_warnings():  # no op left to torch (histc and the experts'
        warnings.simplefilter("error", KilnWarning)  # grouped GEMM are kiln's since 0bb7eb1)
        exe = kiln.compile(model, (), {"input_ids": torch.randint(0, 64, (1, 7)),
                                       "use_cache": False},
                           dynamic_shapes={"input_ids": {1: seq}, "use_cache": None})
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        assert rel_err(exe(input_ids=ids, use_cache=False).logits, ref) <= 1e-5
