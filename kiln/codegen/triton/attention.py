"""The attention template: flash-attention forward for a region's SDPA op.

One program computes BLOCK_M query rows of one (batch, kv head) against every key,
keeping a running max and sum (online softmax) so the [T, S] score matrix never
exists. Rows are packed across the query heads that share a kv head (GQA: row r is
head `kv_head * G + r // Tq`, query `r % Tq`), so K and V are read once per kv head,
and decode (Tq = 1) fills a tile with the group's heads instead of padding.

Q, K, V and the mask are read through their views (strided maps, no copies): the
K/V cache [B, Hkv, S, D], q/k/v projections viewed into heads, a [T, S] mask
broadcast to [B, H, T, S]. A boolean mask selects, a float mask is added to the
scaled scores; `is_causal` is top-left aligned, as in torch (key j <= query i).
Sizes may be symbolic: the key loop and every tile are masked, never padded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kiln.codegen.select_kernels import register
from kiln.codegen.triton import strided
from kiln.codegen.triton.params import Params, extent, offset_code
from kiln.codegen.triton.spec import Config, KernelSpec
from kiln.ir.plan import DispatchPlan, Region, RegionKind
from kiln.ir.symbolic import bounds_of
from kiln.target import Target

SDPA = "aten.scaled_dot_product_attention.default"
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634


@dataclass
class AttentionShape:
    """What the kernel computes, read off the region's SDPA op."""

    q: strided.Strided  # [B, H, Tq, D]
    k: strided.Strided  # [B, Hkv, S, D]
    v: strided.Strided  # [B, Hkv, S, Dv]
    mask: strided.Strided | None  # [B, H, Tq, S]
    mask_kind: str | None  # "bool" | "add"
    causal: bool
    scale: float
    group: int  # query heads per kv head
    dtype: torch.dtype  # of q/k/v and the output

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    @property
    def value_dim(self) -> int:
        return self.v.shape[3]


def sdpa_arguments(op) -> dict:
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"]
    out = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
           "enable_gqa": False}
    out.update(dict(zip(names, op.args)))
    out.update(op.kwargs)
    return out


def _as_4d(op: strided.Strided) -> strided.Strided | None:
    if op.rank == 4:
        return op
    if op.rank == 3:  # (N, L, E): one head
        return strided.Strided(op.value, (op.shape[0], 1, *op.shape[1:]),
                               (op.strides[0], 0, *op.strides[1:]), op.offset)
    return None


def _broadcast(op: strided.Strided, shape) -> strided.Strided | None:
    """`op` read at the indices of `shape`: size-1 dims get stride 0."""
    st = []
    for n, s, want in zip(op.shape, op.strides, shape):
        if strided._eq(n, want):
            st.append(s)
        elif strided._eq(n, 1):
            st.append(0)
        else:
            return None
    return strided.Strided(op.value, tuple(shape), tuple(st), op.offset)


def analyse(region: Region, plan: DispatchPlan) -> AttentionShape | None:
    """The region's attention as strided operands, or None if the template cannot run it."""
    anchor = region.anchor()
    if anchor.target != SDPA or region.outputs != [anchor.name]:
        return None
    a = sdpa_arguments(anchor)
    if a["dropout_p"] not in (0, 0.0) or anchor.dtype not in _FLOATS:
        return None
    ops = [strided.resolve(region, a[n], plan.values) for n in ("query", "key", "value")]
    if any(o is None for o in ops):
        return None
    q, k, v = (_as_4d(o) for o in ops)
    if q is None or k is None or v is None:
        return None
    if any(plan.values[o.value].dtype != anchor.dtype for o in (q, k, v)):
        return None
    B, H, Tq, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    if not all(isinstance(x, int) for x in (H, Hkv, D, Dv)) or k.shape[3] != D:
        return None
    if Hkv == H:
        group = 1
    elif Hkv == 1 or (a["enable_gqa"] and H % Hkv == 0):
        group = H // Hkv
    else:
        return None
    k = _broadcast(k, (B, Hkv, S, D))
    v = _broadcast(v, (B, Hkv, S, Dv))
    if k is None or v is None:
        return None
    mask, mask_kind = None, None
    if a["attn_mask"] is not None:
        m = strided.resolve(region, a["attn_mask"], plan.values)
        if m is None or m.rank > 4:
            return None
        rank3 = q.rank == 4 and len(ops[0].shape) == 3
        m = m.with_rank(3 if rank3 else 4)
        if rank3:
            m = _as_4d(m)
        mask = _broadcast(m, (B, H, Tq, S))
        dt = plan.values[m.value].dtype
        mask_kind = "bool" if dt == torch.bool else "add" if dt in _FLOATS else None
        if mask is None or mask_kind is None:
            return None
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(D)
    return AttentionShape(q, k, v, mask, mask_kind, bool(a["is_causal"]), float(scale), group,
                          anchor.dtype)


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def config_space(shape: AttentionShape, rows_hi: int | None) -> list[Config]:
    """Candidate tiles: BLOCK_M over packed query rows, BLOCK_N over keys."""
    d = _pow2(max(shape.head_dim, shape.value_dim))
    small = rows_hi is not None and rows_hi <= 16
    block_ms = [16] if small else [16, 32, 64, 128]
    block_ns = [n for n in (16, 32, 64, 128) if n * d <= 128 * 128]
    configs = []
    for bm in block_ms:
        for bn in block_ns:
            for warps in (4, 8):
                if bm * bn < 64 * warps * 4 and warps > 4:
                    continue
                for stages in (1, 2, 3):
                    configs.append(Config.make(warps, stages, BLOCK_M=bm, BLOCK_N=bn))
    return configs


def heuristic(shape: AttentionShape, rows_hi: int | None) -> Config:
    d = _pow2(max(shape.head_dim, shape.value_dim))
    if rows_hi is not None and rows_hi <= 16:
        return Config.make(4, 2, BLOCK_M=16, BLOCK_N=64 if d <= 128 else 32)
    if d <= 64:
        return Config.make(4, 2, BLOCK_M=128, BLOCK_N=64)
    if d <= 128:
        return Config.make(8, 2, BLOCK_M=128, BLOCK_N=64)
    return Config.make(8, 1, BLOCK_M=64, BLOCK_N=32)


@register(RegionKind.ATTENTION)
def generate(region: Region, plan: DispatchPlan, target: Target) -> KernelSpec | None:
    shape = analyse(region, plan)
    if shape is None:
        return None
    return _AttentionSource(region, plan, shape).spec()


class _AttentionSource:
    def __init__(self, region: Region, plan: DispatchPlan, shape: AttentionShape):
        self.region = region
        self.plan = plan
        self.s = shape
        self.p = Params(plan.symbols)
        self.name = f"attention_{region.name}"

    def spec(self) -> KernelSpec:
        s, p = self.s, self.p
        vals = self.plan.values
        q = p.tensor("q_ptr", s.q.value, vals[s.q.value].dtype)
        k = p.tensor("k_ptr", s.k.value, vals[s.k.value].dtype)
        v = p.tensor("v_ptr", s.v.value, vals[s.v.value].dtype)
        m = p.tensor("mask_ptr", s.mask.value, vals[s.mask.value].dtype) if s.mask else None
        out = self.region.outputs[0]
        o = p.tensor("out_ptr", out, vals[out].dtype)
        B, H, Tq, _ = s.q.shape
        S = s.k.shape[2]
        hkv = H // s.group
        for op in (s.q, s.k, s.v) + ((s.mask,) if s.mask else ()):
            p.check_extent(extent(op))
        p.check_extent(B * H * Tq * s.value_dim)
        rows = s.group * Tq
        grid = (f"cdiv({p.grid(rows)}, BLOCK_M)", p.grid(B * hkv))
        body = self._body(q, k, v, m, o, p.size(Tq), p.size(S), hkv, H)
        params = ", ".join([a.name for a in p.args()] + ["BLOCK_M: tl.constexpr",
                                                         "BLOCK_N: tl.constexpr"])
        source = (
            "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
            f"def {self.name}({params}):\n" + body)
        rows_hi = bounds_of(rows, self.plan.symbols).hi
        default = heuristic(s, rows_hi)
        configs = config_space(s, rows_hi)
        if default not in configs:
            configs.insert(0, default)
        meta = {"head_dim": s.head_dim, "value_dim": s.value_dim, "group": s.group,
                "dtype": str(s.dtype).replace("torch.", ""), "causal": s.causal,
                "mask": s.mask_kind, "head_dim_pad": _pow2(max(s.head_dim, s.value_dim)),
                "prologue_tiles": 0}
        return KernelSpec(self.name, source, p.args(), ["BLOCK_M", "BLOCK_N"], grid, configs,
                          default, "attention", meta, 64 if p.needs_int64 else 32)

    def _body(self, q, k, v, m, o, tq, s_len, hkv, heads) -> str:
        s, p = self.s, self.p
        d, dv = s.head_dim, s.value_dim
        dp, dvp = _pow2(d), _pow2(dv)
        wide = ".to(tl.int64)" if p.needs_int64 else ""
        ieee = ', input_precision="ieee"' if s.dtype == torch.float32 else ""
        L = []
        add = L.append
        add("pid_m = tl.program_id(0)")
        add(f"pid_z = tl.program_id(1){wide}")
        add(f"b = pid_z // {hkv}")
        add(f"kvh = pid_z % {hkv}")
        add(f"rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M){wide}")
        add(f"head = kvh * {s.group} + rows // {tq}")
        add(f"qi = rows % {tq}")
        add(f"row_ok = rows < {s.group} * {tq}")
        add(f"d = tl.arange(0, {dp})")
        add(f"dv = tl.arange(0, {dvp})")
        qoff = offset_code(p, s.q, ["b", "head[:, None]", "qi[:, None]", "d[None, :]"])
        add(f"q = tl.load({q} + {qoff}, mask=row_ok[:, None] & (d[None, :] < {d}), other=0.0)")
        add(f"qk_scale = {s.scale * LOG2E!r}")
        add('m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)')
        add("l_i = tl.zeros([BLOCK_M], tl.float32)")
        add(f"acc = tl.zeros([BLOCK_M, {dvp}], tl.float32)")
        if s.causal:
            add(f"hi = tl.minimum({s_len}, tl.max(tl.where(row_ok, qi, 0)) + 1)")
        else:
            add(f"hi = {s_len}")
        add("for start_n in range(0, hi, BLOCK_N):")
        add(f"    n = start_n + tl.arange(0, BLOCK_N){wide}")
        add(f"    n_ok = n < {s_len}")
        koff = offset_code(p, s.k, ["b", "kvh", "n[None, :]", "d[:, None]"])
        add(f"    kt = tl.load({k} + {koff}, mask=n_ok[None, :] & (d[:, None] < {d}), other=0.0)")
        add(f"    qk = tl.dot(q, kt{ieee}, out_dtype=tl.float32)")
        add("    ok = n_ok[None, :] & row_ok[:, None]")
        if s.causal:
            add("    ok = ok & (n[None, :] <= qi[:, None])")
        if s.mask is not None:
            moff = offset_code(p, s.mask, ["b", "head[:, None]", "qi[:, None]", "n[None, :]"])
            if s.mask_kind == "bool":
                add(f"    ok = ok & (tl.load({m} + {moff}, mask=ok, other=0) != 0)")
                add("    sc = qk * qk_scale")
            else:
                add(f"    bias = tl.load({m} + {moff}, mask=ok, other=0.0).to(tl.float32)")
                add(f"    sc = qk * qk_scale + bias * {LOG2E!r}")
        else:
            add("    sc = qk * qk_scale")
        add('    sc = tl.where(ok, sc, float("-inf"))')
        add("    m_new = tl.maximum(m_i, tl.max(sc, 1))")
        add("    m_use = tl.where(m_new == float(\"-inf\"), 0.0, m_new)")  # fully masked rows
        add("    pr = tl.exp2(sc - m_use[:, None])")
        add("    alpha = tl.exp2(m_i - m_use)")
        add("    l_i = l_i * alpha + tl.sum(pr, 1)")
        voff = offset_code(p, s.v, ["b", "kvh", "n[:, None]", "dv[None, :]"])
        add(f"    vt = tl.load({v} + {voff}, mask=n_ok[:, None] & (dv[None, :] < {dv}), "
            "other=0.0)")
        add(f"    acc = tl.dot(pr.to(vt.dtype), vt, acc * alpha[:, None]{ieee}, "
            "out_dtype=tl.float32)")
        add("    m_i = m_new")
        add("acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]")
        add(f"ooff = ((b * {heads} + head[:, None]) * {tq} + qi[:, None]) * {dv} + dv[None, :]")
        add(f"tl.store({o} + ooff, acc.to({o}.dtype.element_ty), "
            f"mask=row_ok[:, None] & (dv[None, :] < {dv}))")
        return "".join(f"    {line}\n" for line in L)
