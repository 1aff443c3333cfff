"""kiln.ir.ops' shared vocabulary: named op sets, axis normalisation, binding by schema."""

import torch
import torch.fx as fx

from kiln.ir.ops import (
    RESHAPES,
    SHAPE_ONLY_OPS,
    SPLITS,
    SQUEEZES,
    UNIT_DIM_OPS,
    OpCategory,
    bind_args,
    bind_call,
    category,
    norm_axis,
    reduction_dims,
)
from kiln.ir.plan import Op, Ref


def test_named_view_sets_are_views_and_compose():
    assert SHAPE_ONLY_OPS == RESHAPES | UNIT_DIM_OPS
    assert SQUEEZES < UNIT_DIM_OPS and not RESHAPES & UNIT_DIM_OPS
    assert all(category(n) == OpCategory.VIEW for n in SHAPE_ONLY_OPS | SPLITS)


def test_norm_axis_counts_negative_dims_from_the_end():
    assert [norm_axis(d, 4) for d in (0, 3, -1, -4)] == [0, 3, 3, 0]
    assert norm_axis(-1, 0) == 0  # a 0-d tensor's dim argument names no axis


def test_bind_fills_schema_defaults_for_plan_ops_and_fx_nodes():
    op = Op("y", "aten.slice.Tensor", (Ref("x"), -1), {"end": 8}, (4, 8), torch.float32)
    assert bind_args(op) == {"self": Ref("x"), "dim": -1, "start": None, "end": 8, "step": 1}
    g = fx.Graph()
    x = g.placeholder("x")
    node = g.call_function(torch.ops.aten.select.int, (x, 1, -2))
    assert bind_args(node) == {"self": x, "dim": 1, "index": -2}
    assert bind_call("aten.cat.default", ([x],), {}) == {"tensors": [x], "dim": 0}


def test_reduction_dims_reads_dims_by_schema():
    assert reduction_dims("aten.sum.dim_IntList", ("x", [-1]), {}, 3) == (2,)
    assert reduction_dims("aten.sum.default", ("x",), {}, 3) == (0, 1, 2)
    assert reduction_dims("aten.amax.default", ("x",), {"dim": [0, -1]}, 3) == (0, 2)
    assert reduction_dims("aten.argmax.default", ("x",), {}, 2) == (0, 1)
    assert reduction_dims("aten._softmax.default", ("x", -1, False), {}, 4) == (3,)
    assert reduction_dims("aten.native_layer_norm.default", ("x", [8, 16], None, None, 1e-5),
                          {}, 3) == (1, 2)
