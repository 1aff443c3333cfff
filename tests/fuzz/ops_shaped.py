"""Catalogue: matmul, views, cat/stack, norms, gathers, attention, in-place buffer writes."""

from __future__ import annotations

from tests.fuzz.catalogue import is_float, op, static_axes
from tests.fuzz.spec import DYN, FLOATS, Node

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
    v = b.pick(lambda m: bool(static_axes(m[0])))
    shape = b.meta[v][0]
    d = b.rng.choice(static_axes(shape))
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
    v = b.pick(lambda m: len(m[0]) >= 1 and m[0][-1] != DYN and is_float(m))
    shape, dt = b.meta[v]
    n = shape[-1]
    w = b.operand((n,), b.key(dt), param=True) if b.rng.random() < 0.7 else "None"
    bias = b.operand((n,), b.key(dt), param=True) if b.rng.random() < 0.5 else "None"
    return Node(b.new_name(), "layer_norm", [v, w, bias], {"n": n})


@op("rms_norm", "{0} * torch.rsqrt({0}.pow(2).mean(-1, keepdim=True) + 1e-6) * {1}", weight=0.5)
def _gen_rms(b):
    v = b.pick(lambda m: len(m[0]) >= 1 and m[0][-1] != DYN and is_float(m))
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
    v = b.pick(lambda m: bool(static_axes(m[0])))
    shape = b.meta[v][0]
    d = b.rng.choice(static_axes(shape))
    idx = b.operand((b.dim(),), "i64", high=shape[d])
    return Node(b.new_name(), "index_select", [v, idx], {"d": d, "top": shape[d] - 1})


@op("gather", "torch.gather({0}, {d}, {1}.clamp(0, {top}))", weight=0.3)
def _gen_gather(b):
    v = b.pick(lambda m: bool(static_axes(m[0])))
    shape = b.meta[v][0]
    d = b.rng.choice(static_axes(shape))
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
        extra = (f", attn_mask=torch.ones({q}.shape[-2], {k}.shape[-2], dtype=torch.bool, "
                 f"device={q}.device).tril()")
    elif p["mask"] == "tensor":
        extra = f", attn_mask={ins[3]}"
    else:
        extra = ""
    return f"F.scaled_dot_product_attention({q}, {k}, {v}{extra})"


@op("sdpa", _render_sdpa, weight=0.6)
def _gen_sdpa(b):
    q = b.pick(lambda m: len(m[0]) >= 3 and is_float(m))
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
    return [f"self.{ins[1]}.index_copy_({p['d']}, torch.tensor({p['idx']}, "
            f"device={ins[0]}.device), {ins[0]})",
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
