"""The plan <-> JSON encoding behind manifest.json: every argument type, whole plans."""

import json
import math

import pytest
import sympy
import torch

import kiln
from kiln.artifact.manifest import (
    ManifestFormatError,
    decode_arg,
    encode_arg,
    plan_from_json,
    plan_to_json,
)
from kiln.artifact.save import dumps
from kiln.errors import ArtifactError
from kiln.ir.plan import Ref, Sym
from kiln.ir.printer import print_plan
from kiln.ir.symbolic import parse, symbol

s0, s1 = symbol("s0"), symbol("s1")

ARGS = [
    Ref("x"), Sym(s0), Sym(2 * s0 + s1), Sym(parse("FloorDiv(s0, 2)")), 0, -7, 2**40, 1.5,
    -0.0, 1e-300, True, False, None, "floor", [1, 2, 3], (1, (2, 3)), [None, Ref("i")],
    (Ref("a"), [Sym(s1), 4]), torch.float32, torch.bfloat16, torch.int64, torch.bool,
    torch.device("cpu"), torch.device("cuda", 1), torch.strided, torch.contiguous_format,
    torch.channels_last, [],
]


@pytest.mark.parametrize("arg", ARGS, ids=repr)
def test_argument_round_trips_through_json_text(arg):
    back = decode_arg(json.loads(json.dumps(encode_arg(arg, "op"))))
    assert back == arg
    assert type(back) is type(arg)
    if isinstance(arg, float):
        assert math.copysign(1, back) == math.copysign(1, arg)


@pytest.mark.parametrize("x", [math.inf, -math.inf, math.nan])
def test_non_finite_floats_are_strict_json(x):
    text = json.dumps(encode_arg(x, "op"), allow_nan=False)  # no bare Infinity / NaN
    back = decode_arg(json.loads(text))
    assert isinstance(back, float)
    assert (math.isnan(back) and math.isnan(x)) or back == x


def test_sym_keeps_symbol_assumptions():
    back = decode_arg(encode_arg(Sym(s0 * 4), "op"))
    assert back.expr == s0 * 4 and isinstance(back.expr, sympy.Expr)


def test_unknown_argument_type_names_the_op():
    with pytest.raises(ArtifactError, match=r"op %mul.*complex"):
        encode_arg(1 + 2j, "op %mul")


@pytest.mark.parametrize("bad,why", [
    ({"what": 1}, "unknown argument tag 'what'"),
    ({"dtype": "not_a_dtype"}, "unknown torch dtype 'not_a_dtype'"),
    ({"layout": "float32"}, "unknown torch layout 'float32'"),
    ({"ref": "a", "sym": "b"}, "unreadable op argument"),
])
def test_unreadable_argument_is_a_format_error(bad, why):
    with pytest.raises(ManifestFormatError, match=why):
        decode_arg(bad)


class _Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x, flag: bool = True):
        y = torch.nn.functional.softmax(x @ self.w, dim=-1)
        y = y.masked_fill(y < 0.01, float("-inf")).to(torch.bfloat16)
        return y.float().reshape(-1, 4, 2).sum(1)


def test_plan_round_trip_prints_identically():
    T = kiln.Dim("T", min=2, max=64)
    exe = kiln.compile(_Small(), (torch.randn(6, 8), True), dynamic_shapes=({0: T}, None))
    text = dumps(plan_to_json(exe.plan))
    back = plan_from_json(json.loads(text))
    assert print_plan(back) == print_plan(exe.plan)
    assert back.const_args == exe.plan.const_args == {1: True}
    assert back.in_spec and back.out_spec
    assert [r.where() for r in back.regions] == [r.where() for r in exe.plan.regions]


def test_an_attention_regions_mask_envelope_round_trips():
    """A loaded plan (an artifact, a compile-cache hit) keeps which values bound each
    attention region's key loop: a kernel generated again from it reads them."""

    class Masked(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    plan = kiln.compile(Masked(), (q, k, v, torch.rand(1, 1, 8, 8) > 0.5), target="interpret",
                        compile_to="dispatch")
    back = plan_from_json(json.loads(dumps(plan_to_json(plan))))
    bounds = [r.key_bounds for r in plan.regions if r.key_bounds]
    assert len(bounds) == 1 and len(bounds[0]) == 3
    assert [r.key_bounds for r in back.regions] == [r.key_bounds for r in plan.regions]


def test_dumps_is_json_and_indented():
    obj = {"a": [1, 2], "b": {"c": "x" * 120, "d": [[1, 2]] * 40}}
    text = dumps(obj)
    assert json.loads(text) == obj
    assert "\n" in text and '"a": [1, 2]' in text
