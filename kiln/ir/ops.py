"""The ATen ops kiln understands, each with the category that decides how it is fused.

An op not listed here (ATen's, or a library's torch.library custom op) falls back: it
is an EXTERN op (its own region, run as PyTorch's own op on every target) when that
is safe to do blindly: it writes none of
its arguments, is not random, and returns tensors (`fallback_problem`). Others are an
UnsupportedOpError at import, as is every unlisted op under `fallback="error"`.
kiln's own custom ops (`kiln::...`, kiln/ops) are listed too; importing kiln.ops here
registers them, so `resolve` finds them even in a process that only loads an artifact.
"""

from __future__ import annotations

import functools
import operator
from enum import StrEnum

import torch

import kiln.ops  # noqa: F401  (registers the kiln:: custom ops resolve() may name)


class OpCategory(StrEnum):
    VIEW = "view"  # no data movement: folds into the consumer's index map
    POINTWISE = "pointwise"  # elementwise math and casts
    CREATE = "create"  # tensors made from nothing (arange, full): recomputed per use
    GATHER = "gather"  # indirect loads (embedding, index): fuse like pointwise
    CONCAT = "concat"  # each output element comes from one input: fuses like pointwise
    REDUCTION = "reduction"  # reduces some axes of one input
    TOPK = "topk"  # the k largest / smallest along one axis: a kernel of its own
    MATMUL = "matmul"
    ATTENTION = "attention"
    SCATTER = "scatter"  # writes a subset of a tensor (KV-cache updates): copy regions
    EXTERN = "extern"  # run as the framework's own op (sort, cumsum, ...)
    TUPLE = "tuple"  # getitem on a multi-output op


def _names(*names: str) -> list[str]:
    return [f"aten.{n}" for n in names]


_TABLE: dict[str, OpCategory] = {}


def _register(category: OpCategory, names: list[str]) -> None:
    for n in names:
        _TABLE[n] = category


_register(
    OpCategory.VIEW,
    _names(
        "view.default", "_unsafe_view.default", "reshape.default", "permute.default",
        "transpose.int", "t.default", "expand.default", "unsqueeze.default",
        "squeeze.default", "squeeze.dim", "squeeze.dims", "slice.Tensor", "select.int",
        "alias.default", "view_as_real.default", "unfold.default", "diagonal.default",
        "split_with_sizes.default", "split.Tensor", "unbind.int",
    ),
)
_register(
    OpCategory.POINTWISE,
    _names(
        "add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "rsub.Scalar", "rsub.Tensor",
        "mul.Tensor", "mul.Scalar", "div.Tensor", "div.Scalar", "div.Tensor_mode",
        "div.Scalar_mode", "neg.default", "abs.default", "exp.default", "exp2.default",
        "expm1.default", "log.default", "log2.default", "log1p.default", "sqrt.default",
        "rsqrt.default", "reciprocal.default", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
        "pow.Scalar", "sin.default", "cos.default", "tan.default", "tanh.default",
        "sigmoid.default", "silu.default", "gelu.default", "relu.default", "erf.default",
        "sign.default", "floor.default", "ceil.default", "round.default", "trunc.default",
        "maximum.default", "minimum.default", "clamp.default", "clamp.Tensor",
        "clamp_min.default", "clamp_max.default", "where.self", "where.ScalarSelf",
        "where.ScalarOther", "eq.Tensor", "eq.Scalar", "ne.Tensor", "ne.Scalar",
        "lt.Tensor", "lt.Scalar", "le.Tensor", "le.Scalar", "gt.Tensor", "gt.Scalar",
        "ge.Tensor", "ge.Scalar", "logical_and.default", "logical_or.default",
        "logical_not.default", "logical_xor.default", "bitwise_and.Tensor",
        "bitwise_or.Tensor", "bitwise_xor.Tensor", "bitwise_not.default",
        "bitwise_and.Scalar", "bitwise_or.Scalar", "isnan.default", "isinf.default",
        "fmod.Tensor", "fmod.Scalar", "remainder.Tensor", "remainder.Scalar",
        "masked_fill.Scalar", "masked_fill.Tensor", "_to_copy.default", "clone.default",
        "lerp.Scalar", "lerp.Tensor", "atan2.default", "sinh.default", "cosh.default",
        "asin.default", "acos.default", "atan.default", "hardtanh.default",
        "leaky_relu.default", "elu.default", "softplus.default", "copy.default",
        "lift_fresh_copy.default", "detach.default", "logit.default",
    ),
)
_register(
    OpCategory.CREATE,
    _names(
        "arange.start_step", "arange.default", "arange.start", "full.default",
        "scalar_tensor.default", "zeros.default", "ones.default", "empty.memory_format",
        "full_like.default", "zeros_like.default", "ones_like.default",
        "empty_like.default", "iota.default", "empty_permuted.default",
    ),
)
_register(
    OpCategory.GATHER,
    _names("embedding.default", "index.Tensor", "index_select.default", "gather.default"),
)
_register(OpCategory.CONCAT, _names("cat.default", "constant_pad_nd.default"))
_register(
    OpCategory.REDUCTION,
    _names(
        "sum.dim_IntList", "sum.default", "mean.dim", "mean.default", "amax.default",
        "amin.default", "max.dim", "min.dim", "max.default", "min.default",
        "argmax.default", "argmin.default", "prod.dim_int", "prod.default",
        "var.correction", "var.dim", "var_mean.correction", "any.dim", "any.dims",
        "any.default", "all.dim", "all.default", "_softmax.default", "_log_softmax.default",
        "native_layer_norm.default", "logsumexp.default", "linalg_vector_norm.default",
    ),
)
_register(OpCategory.TOPK, _names("topk.default"))
_register(OpCategory.MATMUL, _names("mm.default", "bmm.default", "addmm.default"))
_register(
    OpCategory.ATTENTION,
    _names(
        "scaled_dot_product_attention.default",
        "_scaled_dot_product_flash_attention_for_cpu.default",
    ),
)
# kiln.ops.softcap_attention: SDPA's arguments and a cap on the scores
_register(OpCategory.ATTENTION, ["kiln.softcap_attention.default"])
_register(
    OpCategory.SCATTER,
    _names(
        "index_put.default", "index_copy.default", "slice_scatter.default",
        "select_scatter.default", "scatter.src", "scatter.value", "scatter_add.default",
        "index_add.default",
    ),
)
_register(
    OpCategory.EXTERN,
    _names(
        "sort.default", "sort.stable", "cumsum.default", "cumprod.default",
        "argsort.default", "argsort.stable", "multinomial.default", "flip.default",
        "roll.default", "repeat.default", "tril.default", "triu.default",
        "native_group_norm.default", "convolution.default", "avg_pool2d.default",
        "max_pool2d_with_indices.default", "upsample_nearest2d.vec", "rand.default",
        "randn.default", "bernoulli.p", "native_dropout.default", "polar.default",
        "view_as_complex.default", "baddbmm.default", "_cdist_forward.default",
        "lstm.input", "gru.input", "rnn_tanh.input", "rnn_relu.input",
    ),
)
# kiln's custom ops (kiln/ops): opaque regions run by their PyTorch implementation.
_register(OpCategory.EXTERN, ["kiln.gated_delta_rule.default", "kiln.all_reduce.default",
                             "kiln.all_gather.default"])
_register(OpCategory.EXTERN, ["kiln.latent_attention.default"])
_register(OpCategory.EXTERN, ["kiln.fp8_linear.default", "kiln.fp8_quantize.default",
                             "kiln.fp8_scaled_mm.default"])
_register(OpCategory.EXTERN, ["kiln.moe_experts.default", "kiln.moe_experts_fp8.default"])
# grouped GEMMs by offsets (codegen/templates/grouped_mm.py): transformers' MoE experts
_register(OpCategory.EXTERN, ["transformers.grouped_mm_fallback.default",
                             "aten._grouped_mm.default"])

# Named sets of ops: each defined here once, named for exactly what it holds.

# Ops that change no values at all in kiln's value semantics (every tensor is a value).
IDENTITY_OPS = {
    "aten.clone.default", "aten.alias.default", "aten.lift_fresh_copy.default",
    "aten.detach.default",
}
# Logical row-major reshapes to a list of sizes (kiln reads a `view` as a reshape).
RESHAPES = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"}
# The reshapes torch runs only on stride-compatible input; eager kiln runs them as reshape.
STRICT_VIEWS = {"aten.view.default", "aten._unsafe_view.default"}
# Ops that drop unit dims (all of them, or the named ones that are unit).
SQUEEZES = {"aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default"}
# Ops that add or drop unit dims only.
UNIT_DIM_OPS = SQUEEZES | {"aten.unsqueeze.default"}
# Ops that change only the shape of row-major data (same bytes, same order).
SHAPE_ONLY_OPS = RESHAPES | UNIT_DIM_OPS
# Ops returning a tuple of pieces of their input along one dim (read through getitem).
SPLITS = {"aten.split_with_sizes.default", "aten.split.Tensor", "aten.unbind.int"}
# the ops an attention region's kernel computes (SDPA's arguments, by its names)
SDPA = "aten.scaled_dot_product_attention.default"
SOFTCAP_ATTENTION = "kiln.softcap_attention.default"
SDPA_FORMS = (SDPA, SOFTCAP_ATTENTION)
MATMULS = {"aten.mm.default", "aten.bmm.default", "aten.addmm.default"}
# Integer ramps: arange in its overloads.
ARANGES = {"aten.arange.default", "aten.arange.start", "aten.arange.start_step"}
# Functional scatters that write a slice / one index of a dim (per-element selectable).
SLICE_SCATTERS = {"aten.slice_scatter.default", "aten.select_scatter.default"}
# Ops whose result is not a function of their arguments: never merged or folded.
IMPURE_OPS = {
    "aten.rand.default", "aten.randn.default", "aten.bernoulli.p", "aten.native_dropout.default",
    "aten.multinomial.default", "aten.empty.memory_format", "aten.empty_like.default",
    "aten.empty_permuted.default",
}

# Frontend drops these: they assert facts kiln checks itself.
ASSERT_OPS = {
    "aten._assert_tensor_metadata.default", "aten._assert_scalar.default",
    "aten.sym_constrain_range_for_size.default", "aten._assert_async.msg",
    "aten.sym_constrain_range.default",
}

# Functional scatter -> the in-place op that writes the destination's own storage.
INPLACE_OF = {
    "aten.index_put.default": "aten.index_put_.default",
    "aten.index_copy.default": "aten.index_copy_.default",
    "aten.scatter.src": "aten.scatter_.src",
    "aten.scatter.value": "aten.scatter_.value",
    "aten.scatter_add.default": "aten.scatter_add_.default",
    "aten.index_add.default": "aten.index_add_.default",
    "aten.copy.default": "aten.copy_.default",
}


def op_name(target) -> str:
    """The stable string name of an FX call target ('aten.mul.Tensor', 'getitem')."""
    if target is operator.getitem:
        return "getitem"
    return str(target)


def category(name: str) -> OpCategory | None:
    if name == "getitem":
        return OpCategory.TUPLE
    known = _TABLE.get(name)
    if known is None and is_fallback(name):
        return OpCategory.EXTERN
    return known


def is_known(name: str) -> bool:
    """Listed in kiln's table (fused or generated, or a deliberate extern)."""
    return name == "getitem" or name in _TABLE


def is_fallback(name: str) -> bool:
    """An unlisted op kiln runs as PyTorch's own op (see fallback_problem)."""
    return not is_known(name) and fallback_problem(name) is None


# Namespaces whose ops are not run blindly: prims are decomposition internals, and
# higher-order ops carry subgraphs. A library's own custom op (torch.library) is run
# as it is, like an unlisted ATen op, when its schema says that is safe (transformers'
# `grouped_mm_fallback` was, until templates/grouped_mm.py generated it).
_NOT_OPERATORS = {"prims", "higher_order"}


@functools.cache
def fallback_problem(name: str) -> str | None:
    """Why an unlisted op cannot simply run as PyTorch's own op, or None if it can."""
    ns = name.split(".")[0]
    if ns in _NOT_OPERATORS:
        return "it is not an ATen op"
    try:
        op = resolve(name)
    except (AttributeError, ValueError):
        return "torch has no such op"
    if not isinstance(op, torch._ops.OpOverload):
        return "it is not an operator torch.library registered"
    schema = op._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "it writes its arguments in place"
    if torch.Tag.nondeterministic_seeded in op.tags:
        return "it draws random numbers"
    for r in schema.returns:
        kind = str(r.type)
        if kind not in ("Tensor", "Tensor[]", "Tensor?"):
            return f"it returns a {kind}, not tensors"
    if not schema.returns:
        return "it returns nothing"
    return None


def resolve(name: str):
    """The callable for an op name: torch.ops.<namespace>.<op>.<overload> (aten, kiln),
    or operator.getitem."""
    if name == "getitem":
        return operator.getitem
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def norm_axis(d: int, rank: int) -> int:
    """A dim index as torch reads it (negative counts from the end) in 0..rank-1; 0 for
    a 0-d tensor, whose dim arguments (0 or -1) name no axis."""
    return d % rank if rank else 0


@functools.cache
def _schema_args(name: str) -> tuple[tuple[str, object], ...]:
    return tuple((a.name, a.default_value if a.has_default_value() else None)
                 for a in resolve(name)._schema.arguments)


def bind_call(name: str, args, kwargs) -> dict:
    """The arguments of a call to op `name` by schema name, defaults filled in."""
    out = {}
    for i, (arg, default) in enumerate(_schema_args(name)):
        out[arg] = args[i] if i < len(args) else kwargs.get(arg, default)
    return out


def bind_args(op) -> dict:
    """bind_call for an op (a plan Op, whose target is a name, or an FX call node)."""
    name = op.target if isinstance(op.target, str) else op_name(op.target)
    return bind_call(name, op.args, op.kwargs)


def arange_start_step(op) -> tuple:
    """(start, step) of an op in ARANGES (0 and 1 for the overloads without them)."""
    a = bind_args(op)
    return a.get("start", 0), a.get("step", 1)


# The topk kiln generates (codegen/templates/topk.py): a few picks out of a row that
# registers hold whole, as MoE routers make (256 experts top 8, 512 top 10). Larger
# ones (a vocabulary's top 50) run as torch's op.
TOPK_MAX_K = 32
TOPK_MAX_WIDTH = 4096
# ... of values whose order a 32-bit integer key holds exactly
TOPK_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int16,
               torch.int8, torch.uint8)


def topk_args(name: str, args: tuple, kwargs: dict, rank: int) -> tuple[object, int, bool]:
    """(k, the normalised axis, largest) of a topk call on an input of `rank` dims."""
    a = bind_call(name, args, kwargs)
    return a["k"], norm_axis(a["dim"], rank), bool(a["largest"])


def topk_problem(k, width: int | None, dtype: torch.dtype) -> str | None:
    """Why kiln does not generate a topk of `k` over rows of at most `width` elements
    (None: unbounded) of `dtype`, or None when it does."""
    if dtype not in TOPK_DTYPES:
        return f"its input is {dtype}"
    if not isinstance(k, int):
        return "k is a symbolic size"
    if k > TOPK_MAX_K:
        return f"k {k} is over {TOPK_MAX_K}"
    if width is None or width > TOPK_MAX_WIDTH:
        return f"its rows may hold over {TOPK_MAX_WIDTH} elements"
    return None


def reduction_dims(name: str, args: tuple, kwargs: dict, rank: int) -> tuple[int, ...]:
    """Which input axes an op of category REDUCTION reduces (normalised, sorted)."""
    a = bind_call(name, args, kwargs)
    if name == "aten.native_layer_norm.default":
        dims = list(range(rank - len(a["normalized_shape"]), rank))
    else:
        dims = a.get("dim")  # absent (sum.default), None or []: every axis
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            dims = list(range(rank))
        elif isinstance(dims, int):
            dims = [dims]
    return tuple(sorted({norm_axis(d, rank) for d in dims}))
