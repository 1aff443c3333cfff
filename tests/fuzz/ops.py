"""The op catalogue: for each op, how to render it (RENDER) and how to draw one (GEN).

A generator picks operands among the graph's values (or asks for a new input /
parameter of a shape it needs) and returns a Node, or None when nothing fits. It
does not check validity: the driver runs the graph eagerly at two sizes after
every op and drops the op if that fails (graph.infer_meta), so a generator may be
optimistic. To grow the catalogue with kiln's, add a renderer and a generator here.
"""

from __future__ import annotations

from tests.fuzz.graph import DYN, FLOATS, Node

RENDER: dict = {}
GEN: dict = {}
WEIGHT: dict = {}


def op(name: str, render, weight: float = 1.0):
    """Register an op: `render` is a format string over {0}, {1}, ... and p, or a function."""
    if isinstance(render, str):
        def fmt(ins, p, sp, _t=render):
            return _t.format(*ins, **p)
        RENDER[name] = fmt
    else:
        RENDER[name] = render
    WEIGHT[name] = weight

    def deco(gen):
        GEN[name] = gen
        return gen
    return deco


def _is_float(m) -> bool:
    return str(m[1]).split(".")[1] in ("float32", "float16", "bfloat16")


def _static_axes(shape) -> list[int]:
    return [i for i, d in enumerate(shape) if d != DYN]


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
    return f"{ins[0]} {p['sym']} torch.tensor({p['vals']}, dtype={sp.dt(p['dt'])})"


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


@op("arange_add", "{0} + torch.arange({0}.shape[{d}]).reshape({view}).to({0}.dtype)", weight=0.4)
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
    v = b.pick(lambda m: bool(_static_axes(m[0])))
    shape = b.meta[v][0]
    d = b.rng.choice(_static_axes(shape))
    return Node(b.new_name(), "topk", [v], {"d": d, "k": b.rng.randint(1, shape[d]),
                                            "part": b.rng.choice(["values", "indices"])})


@op("sort", "torch.sort({0}, dim={d}).values", weight=0.15)
def _gen_sort(b):
    v = b.pick(lambda m: len(m[0]) >= 1)
    return Node(b.new_name(), "sort", [v], {"d": b.rng.randrange(len(b.meta[v][0]))})


# ---- matmul ---------------------------------------------------------------------------

@op("matmul_w", "{0} @ {1}", weight=1.0)
def _gen_matmul_w(b):
    v = b.pick(lambda m: len(m[0]) >= 1)
    shape, dt = b.meta[v]
    n = b.rng.choice([1, b.dim(), b.dim()])
    w = b.operand((shape[-1], n), b.key(dt), param=True)
    return Node(b.new_name(), "matmul_w", [v, w])


@op("linear", "F.linear({0}, {1}, {2})", weight=0.8)
def _gen_linear(b):
    v = b.pick(lambda m: len(m[0]) >= 1 and m[0][-1] != DYN)
    shape, dt = b.meta[v]
    n = b.rng.choice([1, b.dim(), b.dim()])
    w = b.operand((n, shape[-1]), b.key(dt), param=True)
    bias = b.operand((n,), b.key(dt), param=True) if b.rng.random() < 0.6 else "None"
    return Node(b.new_name(), "linear", [v, w, bias])


@op("matmul", "torch.matmul({0}, {1})", weight=0.7)
def _gen_matmul(b):
    v = b.pick(lambda m: len(m[0]) >= 2)
    shape, dt = b.meta[v]
    n = b.rng.choice([1, b.dim(), shape[-2]])
    other = tuple(shape[:-2]) + (shape[-1], n)
    if b.rng.random() < 0.3:
        other = other[-2:]
    return Node(b.new_name(), "matmul", [v, b.operand(other, b.key(dt))])


@op("bmm", "torch.bmm({0}, {1})", weight=0.4)
def _gen_bmm(b):
    v = b.pick(lambda m: len(m[0]) == 3)
    shape, dt = b.meta[v]
    w = b.operand((shape[0], shape[2], b.rng.choice([1, b.dim()])), b.key(dt))
    return Node(b.new_name(), "bmm", [v, w])


@op("outer_k1", "{0}.unsqueeze(-1) @ {1}", weight=0.2)
def _gen_outer(b):
    v = b.pick(lambda m: len(m[0]) >= 1)
    _, dt = b.meta[v]
    return Node(b.new_name(), "outer_k1", [v, b.operand((1, b.dim()), b.key(dt), param=True)])


# ---- views ----------------------------------------------------------------------------

def _render_reshape(ins, p, sp):
    dims = [f"{ins[0]}.shape[{p['src']}]" if d == DYN else str(d) for d in p["shape"]]
    return f"{ins[0]}.reshape({', '.join(dims)})" if dims else f"{ins[0]}.reshape(())"


@op("reshape", _render_reshape, weight=1.0)
def _gen_reshape(b):
    v = b.pick(lambda m: len(m[0]) >= 1)
    shape = list(b.meta[v][0])
    src = shape.index(DYN) if DYN in shape else 0
    i = b.rng.randrange(len(shape))
    if b.rng.random() < 0.5 and i + 1 < len(shape) and DYN not in shape[i:i + 2]:
        new = shape[:i] + [shape[i] * shape[i + 1]] + shape[i + 2:]  # merge two
    elif shape[i] != DYN and shape[i] > 1:
        f = next((f for f in (2, 3, 4, 5, 7) if shape[i] % f == 0), shape[i])
        new = shape[:i] + [f, shape[i] // f] + shape[i + 1:]  # split one
    else:
        new = shape[:i] + [1] + shape[i:]
    return Node(b.new_name(), "reshape", [v], {"shape": new, "src": src})


@op("permute", "{0}.permute({perm})", weight=0.6)
def _gen_permute(b):
    v = b.pick(lambda m: len(m[0]) >= 2)
    perm = list(range(len(b.meta[v][0])))
    b.rng.shuffle(perm)
    return Node(b.new_name(), "permute", [v], {"perm": tuple(perm)})


@op("transpose", "{0}.transpose({a}, {c})", weight=0.6)
def _gen_transpose(b):
    v = b.pick(lambda m: len(m[0]) >= 2)
    a, c = b.rng.sample(range(len(b.meta[v][0])), 2)
    return Node(b.new_name(), "transpose", [v], {"a": a, "c": c - len(b.meta[v][0])})


@op("unsqueeze", "{0}.unsqueeze({d})", weight=0.4)
def _gen_unsqueeze(b):
    v = b.pick(lambda m: len(m[0]) <= 4)
    return Node(b.new_name(), "unsqueeze", [v], {"d": b.rng.randint(0, len(b.meta[v][0]))})


@op("squeeze", "{0}.squeeze({d})", weight=0.4)
def _gen_squeeze(b):
    v = b.pick(lambda m: 1 in m[0])
    return Node(b.new_name(), "squeeze", [v], {"d": list(b.meta[v][0]).index(1)})


@op("expand", "{0}.expand({sizes})", weight=0.4)
def _gen_expand(b):
    v = b.pick(lambda m: 1 in m[0])
    shape = b.meta[v][0]
    sizes = tuple(b.dim() if d == 1 and b.rng.random() < 0.8 else -1 for d in shape)
    return Node(b.new_name(), "expand", [v], {"sizes": sizes})


@op("slice", "{0}[{idx}]", weight=0.7)
def _gen_slice(b):
    v = b.pick(lambda m: any(d != DYN and d > 1 for d in m[0]))
    shape = b.meta[v][0]
    d = b.rng.choice([i for i, x in enumerate(shape) if x != DYN and x > 1])
    start = b.rng.randrange(shape[d])
    stop = b.rng.randint(start + 1, shape[d])
    step = b.rng.choice([1, 1, 2, 3])
    idx = ", ".join([":"] * d + [f"{start}:{stop}:{step}"])
    return Node(b.new_name(), "slice", [v], {"idx": idx})


@op("select", "{0}.select({d}, {i})", weight=0.5)
def _gen_select(b):
    v = b.pick(lambda m: bool(_static_axes(m[0])))
    shape = b.meta[v][0]
    d = b.rng.choice(_static_axes(shape))
    return Node(b.new_name(), "select", [v], {"d": d, "i": b.rng.randrange(shape[d]) - (
        shape[d] if b.rng.random() < 0.3 else 0)})


@op("chunk", "{0}.chunk({n}, {d})[{i}]", weight=0.3)
def _gen_chunk(b):
    v = b.pick(lambda m: any(d != DYN and d > 1 for d in m[0]))
    shape = b.meta[v][0]
    d = b.rng.choice([i for i, x in enumerate(shape) if x != DYN and x > 1])
    n = b.rng.randint(2, shape[d])
    return Node(b.new_name(), "chunk", [v], {"n": n, "d": d, "i": b.rng.randrange(
        -(-shape[d] // -(-shape[d] // n)))})


@op("flip", "{0}.flip({d})", weight=0.2)
def _gen_flip(b):
    v = b.pick(lambda m: len(m[0]) >= 1)
    return Node(b.new_name(), "flip", [v], {"d": b.rng.randrange(len(b.meta[v][0]))})


@op("contiguous", "{0}.contiguous()", weight=0.2)
def _gen_contiguous(b):
    return Node(b.new_name(), "contiguous", [b.pick()])


# ---- cat / stack ----------------------------------------------------------------------

@op("cat", "torch.cat([{0}, {1}], dim={d})", weight=0.6)
def _gen_cat(b):
    v = b.pick(lambda m: len(m[0]) >= 1)
    shape, dt = b.meta[v]
    d = b.rng.randrange(len(shape))
    other = list(shape)
    if shape[d] != DYN:
        other[d] = b.dim()
    return Node(b.new_name(), "cat", [v, b.operand(tuple(other), b.key(dt))], {"d": d})


@op("stack", "torch.stack([{0}, {1}], dim={d})", weight=0.3)
def _gen_stack(b):
    v = b.pick(lambda m: len(m[0]) <= 3)
    shape, dt = b.meta[v]
    return Node(b.new_name(), "stack", [v, b.operand(shape, b.key(dt))],
                {"d": b.rng.randint(0, len(shape))})


# ---- norms, embedding, gather ---------------------------------------------------------

@op("layer_norm", "F.layer_norm({0}, ({n},), {1}, {2}, eps=1e-5)", weight=0.5)
def _gen_layer_norm(b):
    v = b.pick(lambda m: len(m[0]) >= 1 and m[0][-1] != DYN and _is_float(m))
    shape, dt = b.meta[v]
    n = shape[-1]
    w = b.operand((n,), b.key(dt), param=True) if b.rng.random() < 0.7 else "None"
    bias = b.operand((n,), b.key(dt), param=True) if b.rng.random() < 0.5 else "None"
    return Node(b.new_name(), "layer_norm", [v, w, bias], {"n": n})


@op("rms_norm", "{0} * torch.rsqrt({0}.pow(2).mean(-1, keepdim=True) + 1e-6) * {1}", weight=0.5)
def _gen_rms(b):
    v = b.pick(lambda m: len(m[0]) >= 1 and m[0][-1] != DYN and _is_float(m))
    shape, dt = b.meta[v]
    return Node(b.new_name(), "rms_norm", [v, b.operand((shape[-1],), b.key(dt), param=True)])


@op("embedding", "F.embedding({0}.clamp(0, {top}), {1})", weight=0.5)
def _gen_embedding(b):
    idx = b.pick(lambda m: str(m[1]) == "torch.int64" and len(m[0]) <= 3, create=(
        (b.dim(), DYN if b.dyn else b.dim()), "i64"))
    rows = b.rng.choice([b.dim(), 33])
    table = b.operand((rows, b.dim()), b.rng.choice(FLOATS), param=True)
    return Node(b.new_name(), "embedding", [idx, table], {"top": rows - 1})


@op("index_select", "{0}.index_select({d}, {1}.clamp(0, {top}))", weight=0.3)
def _gen_index_select(b):
    v = b.pick(lambda m: bool(_static_axes(m[0])))
    shape = b.meta[v][0]
    d = b.rng.choice(_static_axes(shape))
    idx = b.operand((b.dim(),), "i64", high=shape[d])
    return Node(b.new_name(), "index_select", [v, idx], {"d": d, "top": shape[d] - 1})


@op("gather", "torch.gather({0}, {d}, {1}.clamp(0, {top}))", weight=0.3)
def _gen_gather(b):
    v = b.pick(lambda m: bool(_static_axes(m[0])))
    shape = b.meta[v][0]
    d = b.rng.choice(_static_axes(shape))
    ishape = list(shape)
    ishape[d] = b.dim()
    idx = b.operand(tuple(ishape), "i64", high=shape[d])
    return Node(b.new_name(), "gather", [v, idx], {"d": d, "top": shape[d] - 1})


# ---- attention ------------------------------------------------------------------------

def _render_sdpa(ins, p, sp):
    q, k, v = ins[:3]
    if p["mask"] == "causal":
        extra = ", is_causal=True"
    elif p["mask"] == "bool":
        extra = (f", attn_mask=torch.ones({q}.shape[-2], {k}.shape[-2], dtype=torch.bool)"
                 ".tril()")
    elif p["mask"] == "tensor":
        extra = f", attn_mask={ins[3]}"
    else:
        extra = ""
    return f"F.scaled_dot_product_attention({q}, {k}, {v}{extra})"


@op("sdpa", _render_sdpa, weight=0.6)
def _gen_sdpa(b):
    q = b.pick(lambda m: len(m[0]) >= 3 and _is_float(m))
    shape, dt = b.meta[q]
    t, e = shape[-2], shape[-1]
    s = t if b.rng.random() < 0.6 else b.dim()
    k = b.operand(tuple(shape[:-2]) + (s, e), b.key(dt))
    v = b.operand(tuple(shape[:-2]) + (s, b.rng.choice([e, b.dim()])), b.key(dt))
    mask = b.rng.choice(["none", "causal", "bool", "tensor"] if s == t else ["none", "tensor"])
    ins = [q, k, v]
    if mask == "tensor":
        ins.append(b.operand((t, s), b.rng.choice([b.key(dt), "bool"])))
    return Node(b.new_name(), "sdpa", ins, {"mask": mask})


# ---- in-place buffer updates ----------------------------------------------------------

def _render_index_copy(ins, p, sp):
    return [f"self.{ins[1]}.index_copy_({p['d']}, torch.tensor({p['idx']}), {ins[0]})",
            f"self.{ins[1]}.clone()"]


@op("buf_index_copy", _render_index_copy, weight=0.4)
def _gen_index_copy(b):
    buf = b.buffer()
    shape = b.buffer_shape(buf)
    d = b.rng.randrange(2)
    idx = b.rng.sample(range(shape[d]), b.rng.randint(1, shape[d]))
    src = list(shape)
    src[d] = len(idx)
    return Node(b.new_name(), "buf_index_copy", [b.operand(tuple(src), "f32"), buf],
                {"d": d, "idx": idx})


def _render_slice_assign(ins, p, sp):
    return [f"self.{ins[1]}[{p['idx']}] = {ins[0]}", f"self.{ins[1]}.clone()"]


@op("buf_slice_assign", _render_slice_assign, weight=0.4)
def _gen_slice_assign(b):
    buf = b.buffer()
    shape = b.buffer_shape(buf)
    d = b.rng.randrange(2)
    start = b.rng.randrange(shape[d])
    stop = b.rng.randint(start + 1, shape[d])
    step = b.rng.choice([1, 2])
    src = list(shape)
    src[d] = len(range(start, stop, step))
    if b.rng.random() < 0.3:
        src[1 - d] = 1  # broadcast along the other dim
    idx = ", ".join([":"] * d + [f"{start}:{stop}:{step}"])
    return Node(b.new_name(), "buf_slice_assign", [b.operand(tuple(src), "f32"), buf],
                {"idx": idx})
