"""The import stage records the user's torch.export.Dim name of each size symbol."""

import torch

import kiln


class Two(torch.nn.Module):
    def forward(self, x, pair):
        return x.sum(-1) + pair[0].sum(-1) + pair[1].sum(-1)


def _graph(dynamic_shapes, args):
    return kiln.compile(Two(), args, dynamic_shapes=dynamic_shapes, compile_to="import")


def _by_name(kg) -> dict[str, str]:
    return {name: sym for sym, name in kg.dim_names.items()}


ARGS = (torch.randn(3, 4), (torch.randn(3, 5), torch.randn(3, 6)))


def test_names_from_a_tuple_spec_with_nesting():
    rows, a = kiln.Dim("rows", max=32), kiln.Dim("a", max=32)
    kg = _graph(({0: rows, 1: a}, ({0: rows}, {0: rows})), ARGS)
    names = _by_name(kg)
    assert set(names) == {"rows", "a"} and set(kg.dim_names) == set(kg.symbols)
    assert names["rows"] != names["a"]


def test_names_from_a_dict_spec_and_unnamed_without_one():
    rows = kiln.Dim("rows", max=32)
    kg = _graph({"x": {0: rows}, "pair": ({0: rows}, {0: rows})}, ARGS)
    assert list(kg.dim_names.values()) == ["rows"]
    assert _graph(None, ARGS).dim_names == {}


def test_names_reach_the_plan():
    rows = kiln.Dim("rows", max=32)
    plan = kiln.compile(Two(), ARGS, dynamic_shapes=({0: rows}, ({0: rows}, {0: rows})),
                        compile_to="dispatch")
    assert list(plan.dim_names.values()) == ["rows"]
