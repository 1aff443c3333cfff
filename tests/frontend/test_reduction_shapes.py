"""A reduction's planned shape follows from its dims and keepdim even where torch's
fake tensor says otherwise (torch 2.11 kept a size-1 dim of linalg_vector_norm)."""

import pytest
import torch

import kiln
from kiln.frontend import export as export_mod
from kiln.frontend.reduction_shapes import fix_reduction_shapes, reduced_shape


class Norms(torch.nn.Module):
    def forward(self, x, y):
        return (torch.linalg.vector_norm(x.prod(0, keepdim=True), dim=-1),
                torch.linalg.vector_norm(y, dim=[-3]).argmin(-1, keepdim=True),
                y.sum([0, 2], keepdim=True), y.amax(-1))


def _as_torch_211(gm):
    """What torch 2.11's export recorded: the input's shape for the norm, and the ops
    after it shaped from that (the argmin of a [1, 5, 3] norm: [1, 5, 1])."""
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.linalg_vector_norm.default:
            node.meta["val"] = node.meta["val"].new_empty(node.args[0].meta["val"].shape)
        elif node.target is torch.ops.aten.argmin.default:
            node.meta["val"] = node.meta["val"].new_empty([1, *node.meta["val"].shape])


def test_shape_rule():
    assert reduced_shape([1], [-1], False) == []
    assert reduced_shape([1, 5, 3], [-3], False) == [5, 3]
    assert reduced_shape([2, 5, 3], [0, 2], True) == [1, 5, 1]
    assert reduced_shape([2, 5], None, False) == []
    assert reduced_shape([2, 5], [], True) == [1, 1]


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_wrong_fake_shapes_are_repaired(monkeypatch, target):
    real = export_mod.fix_reduction_shapes

    def broken_then_fixed(gm):
        _as_torch_211(gm)
        real(gm)

    monkeypatch.setattr(export_mod, "fix_reduction_shapes", broken_then_fixed)
    x, y = torch.randn(4), torch.randn(1, 5, 3)
    exe = kiln.compile(Norms(), (x, y), target=target)
    for out, ref in zip(exe(x, y), Norms()(x, y)):
        assert out.shape == ref.shape
        assert torch.allclose(out.float(), ref.float(), atol=1e-5)


def test_pass_leaves_right_shapes_alone():
    ep = torch.export.export(Norms(), (torch.randn(4), torch.randn(1, 5, 3)))
    before = {n.name: n.meta.get("val") for n in ep.graph.nodes}
    fix_reduction_shapes(ep.graph_module)
    assert all(n.meta.get("val") is before[n.name] for n in ep.graph.nodes)
