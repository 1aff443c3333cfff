"""Catalogue: elementwise ops (unary, binary, where, casts, constants) and reductions."""

from __future__ import annotations

from tests.fuzz.catalogue import op, static_axes
from tests.fuzz.spec import DYN, Node

# ---- elementwise unary ----------------------------------------------------------------

UNARY = {
    "relu": "torch.relu({0})", "tanh": "torch.tanh({0})", "sigmoid": "torch.sigmoid({0})",
    "sin": "torch.sin({0})", "cos": "torch.cos({0})", "neg": "torch.neg({0})",
    "abs": "torch.abs({0})", "gelu": "F.gelu({0})", "gelu_tanh": "F.gelu({0}, approximate='tanh')",
    "silu": "F.silu({0})", "erf": "torch.erf({0})", "floor": "torch.floor({0})",
    "round": "torch.round({0})", "sign": "torch.sign({0})", "exp": "torch.exp({0})",
    "log_abs": "torch.log({0}.abs() + 1)", "sqrt_abs": "torch.sqrt({0}.abs())",
    "rsqrt_abs": "torch.rsqrt({0}.abs() + 0.5)", "recip": "1.0 / ({0}.abs() + 1)",
    "square": "{0} * {0}", "softplus": "F.softplus({0})", "leaky_relu": "F.leaky_relu({0}, 0.1)",
    "pow_abs": "{0}.abs().pow(1.5)", "isnan": "torch.isnan({0})",
    "logical_not": "torch.logical_not({0})", "bitwise_not": "torch.bitwise_not({0})",
    "hardtanh": "F.hardtanh({0})", "expm1": "torch.expm1({0})", "atan": "torch.atan({0})",
}
for _name, _tpl in UNARY.items():
    @op(_name, _tpl, weight=0.35)
    def _gen_unary(b, _name=_name):
        v = b.pick()
        return Node(b.new_name(), _name, [v])


@op("affine", "{0} * {a} + {c}", weight=1.0)
def _gen_affine(b):
    return Node(b.new_name(), "affine", [b.pick()],
                {"a": b.rng.choice([0.5, -2.0, 3.0, 1e-3]), "c": b.rng.choice([1.0, -0.25, 0])})


@op("clamp", "{0}.clamp({lo}, {hi})", weight=0.6)
def _gen_clamp(b):
    lo = b.rng.choice([-1.0, -0.5, 0.0, None])
    hi = b.rng.choice([0.5, 1.0, 2.0, None]) if lo is not None else 1.0
    return Node(b.new_name(), "clamp", [b.pick()], {"lo": lo, "hi": hi})


def _render_cast(ins, p, sp):
    return f"{ins[0]}.to({sp.dt(p['dt'])})"


@op("cast", _render_cast, weight=1.5)
def _gen_cast(b):
    return Node(b.new_name(), "cast", [b.pick()], {"dt": b.rng.choice(list(b.dtypes()))})


# ---- elementwise binary / ternary -----------------------------------------------------

BINARY = {
    "add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}",
    "div": "{0} / ({1}.abs() + 1)", "maximum": "torch.maximum({0}, {1})",
    "minimum": "torch.minimum({0}, {1})", "atan2": "torch.atan2({0}, {1})",
    "lt": "{0} < {1}", "gt": "{0} > {1}", "le": "{0} <= {1}", "ge": "{0} >= {1}",
    "eq": "{0} == {1}", "ne": "{0} != {1}", "logical_and": "torch.logical_and({0}, {1})",
    "logical_or": "torch.logical_or({0}, {1})", "bitwise_xor": "{0} ^ {1}",
    "fmod": "torch.fmod({0}, {1}.abs() + 1)", "remainder": "torch.remainder({0}, {1}.abs() + 1)",
    "lerp": "torch.lerp({0}, {1}, 0.3)", "clamp_t": "torch.clamp({0}, min={1})",
}
_BIN_W = {"add": 1.2, "mul": 1.2, "sub": 0.8}
for _name, _tpl in BINARY.items():
    @op(_name, _tpl, weight=_BIN_W.get(_name, 0.35))
    def _gen_binary(b, _name=_name):
        v = b.pick()
        shape, dt = b.meta[v]
        other_dt = b.key(dt) if b.rng.random() < 0.8 else b.rng.choice(list(b.dtypes()))
        w = b.operand(b.broadcast_of(shape), other_dt)
        ins = [v, w] if b.rng.random() < 0.75 else [w, v]
        return Node(b.new_name(), _name, ins)


@op("where", "torch.where({0}, {1}, {2})", weight=0.8)
def _gen_where(b):
    v = b.pick()
    shape, dt = b.meta[v]
    cond = b.operand(b.broadcast_of(shape), "bool")
    other = b.operand(b.broadcast_of(shape), b.key(dt))
    return Node(b.new_name(), "where", [cond, v, other])


@op("where_scalar", "torch.where({0}, {1}, {s})", weight=0.3)
def _gen_where_scalar(b):
    v = b.pick()
    cond = b.operand(b.broadcast_of(b.meta[v][0]), "bool")
    return Node(b.new_name(), "where_scalar", [cond, v], {"s": b.rng.choice([0.0, -1e4, 2])})


@op("masked_fill", "{1}.masked_fill({0}, {s})", weight=0.3)
def _gen_masked_fill(b):
    v = b.pick()
    cond = b.operand(b.broadcast_of(b.meta[v][0]), "bool")
    return Node(b.new_name(), "masked_fill", [cond, v], {"s": b.rng.choice([0.0, -1e4, 1.5])})


def _render_const(ins, p, sp):
    return (f"{ins[0]} {p['sym']} torch.tensor({p['vals']}, dtype={sp.dt(p['dt'])}, "
            f"device={ins[0]}.device)")


@op("const", _render_const, weight=0.8)
def _gen_const(b):
    v = b.pick()
    shape, dt = b.meta[v]
    n = shape[-1] if shape and shape[-1] != DYN and b.rng.random() < 0.7 else None
    vals = [round(b.rng.uniform(-2, 2), 3) for _ in range(n or 1)]
    key = b.key(dt) if b.rng.random() < 0.8 else "f32"
    if key == "bool":
        vals = [x > 0 for x in vals]
    elif key == "i64":
        vals = [int(x * 3) for x in vals]
    return Node(b.new_name(), "const", [v], {"sym": b.rng.choice(["+", "*", "-"]),
                                             "vals": vals if n else vals[0], "dt": key})


@op("arange_add", "{0} + torch.arange({0}.shape[{d}], device={0}.device).reshape({view})"
                  ".to({0}.dtype)", weight=0.4)
def _gen_arange(b):
    v = b.pick(lambda m: len(m[0]) >= 1)
    rank = len(b.meta[v][0])
    d = b.rng.randrange(rank)
    view = [1] * rank
    view[d] = -1
    return Node(b.new_name(), "arange_add", [v], {"d": d, "view": tuple(view)})


@op("full_like", "torch.full_like({0}, {s})", weight=0.15)
def _gen_full_like(b):
    return Node(b.new_name(), "full_like", [b.pick()], {"s": b.rng.choice([0, 1, 2.5])})


# ---- reductions -----------------------------------------------------------------------

REDUCE = {
    "sum": "{0}.sum({dims}, keepdim={k})", "mean": "{0}.mean({dims}, keepdim={k})",
    "amax": "{0}.amax({dims}, keepdim={k})", "amin": "{0}.amin({dims}, keepdim={k})",
    "var": "{0}.var({dims}, keepdim={k})", "logsumexp": "torch.logsumexp({0}, {dims}, keepdim={k})",
    "any": "{0}.any({d}, keepdim={k})", "argmax": "{0}.argmax({d}, keepdim={k})",
    "argmin": "{0}.argmin({d}, keepdim={k})", "max_dim": "{0}.max({d}, keepdim={k}).values",
    "softmax": "torch.softmax({0}, {d})", "log_softmax": "torch.log_softmax({0}, {d})",
    "sum_all": "{0}.sum()", "prod": "{0}.prod({d}, keepdim={k})",
    "norm": "torch.linalg.vector_norm({0}, dim={dims}, keepdim={k})",
}
_RED_W = {"sum": 1.0, "mean": 0.8, "softmax": 0.8, "amax": 0.6}
for _name, _tpl in REDUCE.items():
    @op(_name, _tpl, weight=_RED_W.get(_name, 0.35))
    def _gen_reduce(b, _name=_name):
        v = b.pick(lambda m: len(m[0]) >= 1)
        rank = len(b.meta[v][0])
        d = b.rng.randrange(rank)
        dims = sorted(b.rng.sample(range(rank), b.rng.randint(1, rank)))
        if b.rng.random() < 0.3:
            dims = [x - rank for x in dims]
        p = {"d": d - rank if b.rng.random() < 0.3 else d, "k": b.rng.random() < 0.5,
             "dims": dims if len(dims) > 1 else dims[0]}
        return Node(b.new_name(), _name, [v], p)


@op("cumsum", "torch.cumsum({0}, {d})", weight=0.4)
def _gen_cumsum(b):
    v = b.pick(lambda m: len(m[0]) >= 1)
    return Node(b.new_name(), "cumsum", [v], {"d": b.rng.randrange(len(b.meta[v][0]))})


@op("topk", "torch.topk({0}, {k}, dim={d}).{part}", weight=0.4)
def _gen_topk(b):
    v = b.pick(lambda m: bool(static_axes(m[0])))
    shape, dt = b.meta[v]
    d = b.rng.choice(static_axes(shape))
    # Which of tied values comes first is unspecified (CPU and CUDA differ): indices
    # only of fp32 values, where ties are rare; tied values are equal either way.
    part = b.rng.choice(["values", "indices"]) if dt == "f32" else "values"
    return Node(b.new_name(), "topk", [v], {"d": d, "k": b.rng.randint(1, shape[d]),
                                            "part": part})


@op("sort", "torch.sort({0}, dim={d}).values", weight=0.15)
def _gen_sort(b):
    v = b.pick(lambda m: len(m[0]) >= 1)
    return Node(b.new_name(), "sort", [v], {"d": b.rng.randrange(len(b.meta[v][0]))})
