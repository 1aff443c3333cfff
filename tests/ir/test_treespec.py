"""Models return any pytree (torch.return_types, namedtuples, dicts, dataclasses) and get
the same structure back from kiln, also after a save and load."""

from __future__ import annotations

import collections
import dataclasses
import json

import pytest
import torch
import torch.utils._pytree as pytree

import kiln
from kiln.ir import treespec

Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: dict
    note: object = None


class TopK(torch.nn.Module):
    def forward(self, x):
        return torch.topk(x, 2)


class Mixed(torch.nn.Module):
    def forward(self, x):
        return x.max(dim=-1), torch.sort(x, descending=True), Pair(x + 1, {"z": x * 2})


class Data(torch.nn.Module):
    def forward(self, x):
        return Out(torch.tanh(x), {"sum": x.sum(-1)})


def _same(a, b):
    assert pytree.tree_structure(a) == pytree.tree_structure(b)
    for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)):
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize("model", [TopK(), Mixed(), Data()], ids=lambda m: type(m).__name__)
def test_structured_outputs_come_back_as_eager_returns_them(model, tmp_path):
    x = torch.randn(3, 5)
    exe = kiln.compile(model, (x,))
    fresh = torch.randn(3, 5)
    out = exe(fresh)
    _same(out, model(fresh))
    assert type(out) is type(model(fresh))
    exe.save(tmp_path / "m.kiln")
    _same(kiln.load(tmp_path / "m.kiln")(fresh), model(fresh))


def test_generated_kernels_return_a_namedtuple_too():
    x = torch.randn(3, 5)
    out = kiln.compile(Mixed(), (x,), target="interpret")(x)
    _same(out, Mixed()(x))


def test_a_class_that_does_not_import_comes_back_as_a_namedtuple_of_its_fields():
    spec = pytree.tree_structure(Out(torch.ones(1), {"s": torch.ones(1)}))
    data = json.loads(treespec.dumps(spec))
    data["tree"]["dataclass"] = "no_such_module:Out"
    rebuilt = treespec.loads(json.dumps(data))
    value = pytree.tree_unflatten([torch.ones(1), torch.zeros(1)], rebuilt)
    assert type(value).__name__ == "Out" and value._fields == ("logits", "extra")
    assert value.extra["s"].item() == 0


def test_torch_format_still_loads():
    spec = pytree.tree_structure(({"a": 1}, [2, 3]))
    assert treespec.loads(pytree.treespec_dumps(spec)) == spec


@dataclasses.dataclass
class Unhashable:  # eq=True, so __hash__ is None, as a user's output class usually is
    logits: torch.Tensor


def test_torch_2_11s_unhashable_output_is_registered_and_retried():
    """torch 2.11 hashes each output leaf (is_opaque_type) before it says "Found <class>
    in output", so an unregistered dataclass of tensors failed with a TypeError from
    torch's own code. kiln finds the leaf in that frame, registers its class and exports
    again. The frame is made here as torch 2.11 has it (any torch runs this test)."""
    from kiln.frontend.export import _unhashable_output

    code = compile("def is_opaque_type(cls):\n    return cls in set()\n",
                   "/site-packages/torch/_library/opaque_object.py", "exec")
    scope: dict = {}
    exec(code, scope)
    with pytest.raises(TypeError) as e:
        scope["is_opaque_type"](Unhashable(torch.ones(1)))
    assert _unhashable_output(e.value) == f"{__name__}:Unhashable"
    assert Unhashable in pytree.SUPPORTED_NODES
    assert _unhashable_output(TypeError("unhashable type: 'list'")) is None  # no such frame
