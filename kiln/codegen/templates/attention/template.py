"""The attention template: flash-attention forward for a region's SDPA op (or
kiln.ops.softcap_attention, SDPA with a cap on the scores).

One program computes BLOCK_M query rows of one (batch, kv head) against every key,
keeping a running max and sum (online softmax) so the [Tq, S] score matrix never
exists. Rows are packed across the query heads that share a kv head (GQA: row r is
head `kv_head * G + r // Tq`, query `r % Tq`), so K and V are read once per kv head,
and decode (Tq = 1) fills a tile with the group's heads instead of padding: one
kernel serves prefill and decode, and stays correct for any Tq.

Q, K, V and the mask are read by the emitter at the tile's indices, through their
views (the K/V cache [B, Hkv, S, D], projections viewed into heads, a [Tq, S] mask
broadcast to [B, H, Tq, S]) and through whatever prologue the region fused: RoPE on
Q and K is computed as they are loaded (the rotate-half partner is the other half of
the head dim, read under the cat's per-element selection), a mask built from arange
and input_pos is computed at (b, h, i, j). A boolean mask selects, a float mask is
added to the scaled scores (in base 2, a finite value kept finite: a row of finfo.min
is uniform, as in eager); `is_causal` is top-left aligned, as in torch (key j <=
query i), and a mask the prologue builds from aranges is recognised as causal
(causal_mask.py). Sizes may be symbolic: the key loop and every tile are masked, never
padded.

The key loop runs in two parts: blocks wholly inside the keys and (causal) at or before
every row's query need no key, row or causal mask; only the rest are masked. Causal row
blocks run longest first, as do those of a mask with an envelope. An explicit mask's
envelope (per mask row, the first key it lets through and one past the last:
kiln.dispatch.mask_envelope, region inputs) bounds the loop to the span its tile's rows
can see; the mask still applies inside it, unless every row of the tile passes exactly
its envelope's keys, unbiased (the envelope's third value: a causal or sliding-window
mask): then the mask is never loaded, keys are compared with the rows' bounds at the
span's edges and the blocks inside every row's span run unmasked, as a causal tile's do
(the plain loops are empty in other tiles by their bounds; the mask's run under one `if
not plain`). An envelope with no count (a mask whose form passes each row a prefix
of the keys: kiln.dispatch.prefix_mask) makes every tile plain: no mask loops at all,
nor their ~60 registers at 8B widths. Key ranges are loop bounds and the `if` is around
whole loops, never around the loads (Triton does not pipeline loads inside an `if`; a
loop inside one pipelines).
kiln.ops.softcap_attention's cap is applied to the scaled scores before the mask, as
cap * tanh(t) in base 2 with one exp2 (1 - 2 / (e^2t + 1): +-cap at either end).
A decode query's per-head norm statistics (a sum or mean of q's row over the head dim,
folded in by kiln.dispatch.fold_query_norm) are summed across the query tile's head-dim
lanes, which hold each head's whole row.
When the tiles are too few to fill the GPU (decode: one tile per KV head), the keys are
split across programs (kiln.codegen.templates.split_k): each keeps its unnormalised
output with its running max and sum, and the last program of a tile merges them by their
maxima.
A decode step's K/V cache writes folded in (kiln.dispatch.fold_cache_writes) are stored
by the program whose key range holds the written position, before its key loop reads
the caches' memory (`_cache_writes`): one launch fewer a layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kiln.codegen.build.spec import Config, KernelSpec
from kiln.codegen.expr.emit import Emitter, kernel_name, module_source
from kiln.codegen.expr.indexing import Lin, Var, floordiv, modidx
from kiln.codegen.expr.kernel_args import SymbolicArgs
from kiln.codegen.expr.values import CodegenUnsupported, Cond, Val, mask_of
from kiln.codegen.expr.views import is_view, source_index
from kiln.codegen.templates import load_order
from kiln.codegen.templates import split_k as split
from kiln.codegen.templates.attention.repeated_heads import repeated_heads
from kiln.codegen.templates.copy import destination, update_shape
from kiln.codegen.templates.matmul.configs import can_split
from kiln.codegen.templates.matmul.template import dot_operand
from kiln.codegen.templates.op_operands import operand_shape as _shape
from kiln.dispatch.causal_mask import is_causal_mask
from kiln.dispatch.fold_query_norm import head_dim_sum
from kiln.ir.ops import SDPA_FORMS, OpCategory, bind_args, category
from kiln.ir.plan import DispatchPlan, Ref, Region
from kiln.ir.symbolic import Dim, bounds_of, same_dim, to_str
from kiln.target import Target

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634
FLT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max
MIN_SPLIT_BLOCKS = 2  # key blocks a split gets at least
SPLIT_CAP = 32  # most parts the keys are split into (decode: 8 KV heads x 16 splits)
# Decode tiles (16 rows) whose keys one program an SM would split fewer than
# FEW_SPLITS ways fill two programs an SM instead: the kernel holds 150 registers and
# 55 KB at 4 warps (sm_90, head dim 96-128), three fit an SM. At one an SM, 32 KV heads
# (multi-head attention: Phi-3, Llama-2, OLMo) got 4 splits, each walking a quarter of
# the keys one latency-bound block after another: H200, the kernel alone at Llama-2-7B
# widths (probes/decode_attention.py), 16.39 -> 14.51 us at context 2048, 9.33 -> 8.84
# at 512, 6.96 -> 7.24 at 128. With 8 KV heads (16 splits) two an SM gave 18 splits,
# 10.23 -> 10.57 us at 2048: more parts to merge, the same walk; such tiles keep one.
DECODE_PROGRAMS_PER_SM, FEW_SPLITS = 2, 8


@dataclass
class AttentionShape:
    """What the kernel computes, read off the region's SDPA op."""

    q: str  # operand names (region inputs or ops)
    k: str
    v: str
    mask: str | None
    mask_kind: str | None  # "bool" | "add"
    causal: bool
    scale: float
    batch: Dim
    heads: int
    kv_heads: int
    tq: Dim  # query length
    s: Dim  # key length
    head_dim: int
    value_dim: int
    dtype: torch.dtype
    kv_repeat: int = 1  # K/V hold H heads, head h a repeat of kv head h // kv_repeat
    # region inputs: per mask row, its first live key, one past its last and how many
    # keys it passes unchanged (kiln.dispatch.mask_envelope); the key loop stays within
    # its tile's rows' span
    key_bounds: tuple[str, str, str | None] | None = None
    softcap: float | None = None  # scores capped at +-softcap by tanh before the mask

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def sdpa_arguments(op) -> dict:
    """SDPA's arguments by name, or kiln.ops.softcap_attention's (no dropout, a
    `softcap`; SDPA's is None)."""
    out = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
           "enable_gqa": False, "softcap": None}
    out.update(bind_args(op))
    return out


def analyse(region: Region, plan: DispatchPlan) -> AttentionShape:
    """The region's attention; raises CodegenUnsupported (why) if the template cannot run it."""
    anchor = region.anchor()
    writes = [o.name for o in region.ops if category(o.target) == OpCategory.SCATTER]
    if anchor.target not in SDPA_FORMS or region.outputs != [anchor.name, *writes] \
            or any(w not in region.inplace for w in writes):
        raise CodegenUnsupported("the region's outputs are not its SDPA op alone (and the "
                                 "cache writes folded into it)")
    a = sdpa_arguments(anchor)
    refs = [a["query"], a["key"], a["value"]]
    if a["dropout_p"] not in (0, 0.0):
        raise CodegenUnsupported("SDPA with dropout")
    if anchor.dtype not in _FLOATS:
        raise CodegenUnsupported(f"SDPA in {anchor.dtype}")
    if not all(isinstance(r, Ref) for r in refs):
        raise CodegenUnsupported("a query, key or value that is not a tensor")
    qs, ks, vs = (_shape(region, plan, r.name) for r in refs)
    if not (len(qs) == len(ks) == len(vs) and len(qs) in (3, 4)):
        raise CodegenUnsupported(f"query/key/value of ranks {len(qs)}/{len(ks)}/{len(vs)}")
    if len(qs) == 3:  # (N, L, E): one head
        qs, ks, vs = ((x[0], 1, *x[1:]) for x in (qs, ks, vs))
    B, H, Tq, D = qs
    Hkv, S, Dv = ks[1], ks[2], vs[3]
    if not all(isinstance(x, int) for x in (H, Hkv, D, Dv)):
        raise CodegenUnsupported("symbolic head counts or head dims")
    if ks[3] != D:
        raise CodegenUnsupported(f"key head dim {ks[3]} differs from the query's {D}")
    if not (Hkv == H or Hkv == 1 or (a["enable_gqa"] and H % Hkv == 0)):
        raise CodegenUnsupported(f"{H} query heads over {Hkv} key heads")
    repeat = 1
    if Hkv == H > 1:  # GQA written out: pack the query heads of each kv head in a tile
        rk, rv = (repeated_heads(region, plan, r.name, H) for r in refs[1:])
        repeat = rk if rk == rv else 1
    for x in (ks, vs):
        if not (same_dim(x[0], B) or same_dim(x[0], 1)) or not same_dim(x[2], S):
            raise CodegenUnsupported("key/value batch or length differs from the query's")
    mask, kind = None, None
    if a["attn_mask"] is not None:
        m = a["attn_mask"]
        if not isinstance(m, Ref):
            raise CodegenUnsupported("a mask that is not a tensor")
        dt = plan.values[m.name].dtype if m.name in region.inputs else region.op(m.name).dtype
        kind = "bool" if dt == torch.bool else "add" if dt in _FLOATS else None
        if kind is None:
            raise CodegenUnsupported(f"a {dt} mask")
        if len(_shape(region, plan, m.name)) > len(qs):
            raise CodegenUnsupported("a mask of higher rank than the query")
        mask = m.name
    causal = bool(a["is_causal"])
    if mask is not None and not causal and is_causal_mask(region, mask):
        mask, kind, causal = None, None, True  # skip the blocks above the diagonal
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(D)
    cap = a["softcap"]
    if cap is not None and not (isinstance(cap, (int, float)) and cap > 0):
        raise CodegenUnsupported(f"a softcap of {cap!r}")
    return AttentionShape(refs[0].name, refs[1].name, refs[2].name, mask, kind, causal,
                          float(scale), B, H, Hkv // repeat, Tq, S, D, Dv, anchor.dtype,
                          repeat, _key_bounds(region, plan, mask),
                          None if cap is None else float(cap))


def _key_bounds(region: Region, plan: DispatchPlan, mask: str | None):
    """The region's mask envelope (region.key_bounds), if it has one for `mask`."""
    bounds = region.key_bounds
    if mask is None or bounds is None or len(bounds) != 3 or bounds[0] is None or \
            bounds[1] is None or not all(b in region.inputs for b in bounds if b is not None):
        return None
    rows = _shape(region, plan, mask)[:-1]
    ok = all(len(plan.values[b].shape) == len(rows) and plan.values[b].dtype == torch.int32
             and all(same_dim(x, y) for x, y in zip(plan.values[b].shape, rows))
             for b in bounds if b is not None)
    return bounds if ok else None


def _loop(start: str, end: str, body: list[str], depth: int = 0) -> list[str]:
    """A key loop over [start, end), `depth` levels in."""
    pad = "    " * depth
    return [f"{pad}for start_n in range({start}, {end}, BLOCK_N):",
            *[pad + "    " + x for x in body]]


def _live_splits(kv_start: str) -> list[str]:
    """Lines narrowing a prompt tile's split to the keys its rows reach. The launch
    splits by the key operand's length (the host knows no more); a mask's envelope may
    leave far fewer keys (a 128-token prompt over a 2304-slot static cache: 4 splits of
    128-row parts stored and merged for 2 blocks of keys, 16.6 us against 7.0 without
    a split, H200). Every program of the tile computes the same count; those past it
    leave at once, so one live split stores its output directly, as if unsplit."""
    return [f"n_live = tl.minimum(n_split, tl.maximum(1, tl.cdiv(kv_end - {kv_start}, "
            f"{MIN_SPLIT_BLOCKS} * BLOCK_N)))",
            "if pid_s >= n_live:",
            "    return"]


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def config_space(shape: AttentionShape, rows_hi: int | None) -> list[Config]:
    """Candidate tiles (BLOCK_M over packed query rows, BLOCK_N over keys), largest
    first, so that where the heuristic does not fit the first config that does is big.
    Each may split the keys (up to SPLIT_CAP parts; kiln.codegen.templates.split_k) or not."""
    d = _pow2(max(shape.head_dim, shape.value_dim))
    block_ms = [16] if rows_hi is not None and rows_hi <= 16 else [128, 64, 32, 16]
    block_ns = [n for n in (128, 64, 32, 16) if n * d <= 128 * 128]
    tiles = sorted(((bm, bn) for bm in block_ms for bn in block_ns),
                   key=lambda t: (-t[0] * t[1], -t[0]))
    configs = []
    for bm, bn in tiles:
        for stages in (2, 3, 1):
            for warps in ((8, 4) if bm * bn >= 128 * 64 else (4, 8)):
                if warps == 8 and bm * bn < 64 * 64:
                    continue
                for cap in (SPLIT_CAP, 1) if can_split(bm * d, warps) else (1,):
                    configs.append(Config.make(warps, stages, BLOCK_M=bm, BLOCK_N=bn,
                                               KV_SPLIT=cap))
    return configs


def miscompiled(config: Config, value_pad: int, target: Target) -> bool:
    """A config Triton 3.6 builds wrongly for sm_90: at a 16-wide value tile the wgmma
    P@V (a tile of 64 rows and up: m64n16k16, V an MN-major B operand with a 32-byte
    swizzle) read shared memory out of bounds and poisoned the process's CUDA context:
    on an H100 with one stage (compute-sanitizer over every fast-mode candidate,
    benchmarks/attention_candidates_memcheck.py), then on an H200 with two (the
    default, 128 rows; tests/fuzz/FINDINGS.md). Every wgmma tile at that width is
    left out: 16- and 32-row tiles take mma.sync, which never faulted."""
    return (target.backend == "cuda" and isinstance(target.arch, int) and target.arch >= 90
            and value_pad == 16 and config["BLOCK_M"] >= 64)


def heuristic(shape: AttentionShape, rows_hi: int | None, target: Target) -> Config:
    d = _pow2(max(shape.head_dim, shape.value_dim))
    if rows_hi is not None and rows_hi <= 16:
        warps, stages, bm, bn = 4, 2, 16, 64 if d <= 128 else 32
    elif target.backend == "hip":  # MFMA: one stage; 128-row tiles spill at head dim 128
        warps, stages, bm, bn = 4, 1, 64, 64 if d <= 128 else 32
    elif d <= 64:
        warps, stages, bm, bn = 4, 2, 128, 64
    elif d <= 128:  # three stages on Hopper: causal prefill 2048 at the 8B widths on an
        # H200 132 -> 113 us (benchmarks/probes/prefill_attention.py); Ampere unmeasured
        hopper = target.backend == "cuda" and isinstance(target.arch, int) and target.arch >= 90
        warps, stages, bm, bn = 8, 3 if hopper else 2, 128, 64
    else:
        warps, stages, bm, bn = 8, 1, 64, 32
    if miscompiled(Config.make(warps, stages, BLOCK_M=bm), _pow2(shape.value_dim), target):
        warps, stages, bm = 4, 2, 32  # mma.sync; only tiny test models have such values
    cap = SPLIT_CAP if can_split(bm * d, warps) else 1
    return Config.make(warps, stages, BLOCK_M=bm, BLOCK_N=bn, KV_SPLIT=cap)


def generate(region: Region, plan: DispatchPlan, target: Target) -> KernelSpec:
    """The attention kernel of `region`; raises CodegenUnsupported saying why it declines."""
    return _AttentionSource(region, plan, target, analyse(region, plan)).spec()


class _AttentionSource:
    def __init__(self, region: Region, plan: DispatchPlan, target: Target,
                 shape: AttentionShape):
        self.region, self.plan, self.s = region, plan, shape
        self.p = SymbolicArgs(plan.symbols)
        sums = {o.name: self._row_sum_at(o) for o in region.ops
                if category(o.target) == OpCategory.REDUCTION}
        # the step's cache writes (dispatch/fold_cache_writes.py): stored before the key
        # loop reads them (`_cache_writes`), so K and V read the caches' memory
        self.writes = [o for o in region.ops if category(o.target) == OpCategory.SCATTER]
        self.em = Emitter(region, plan, self.p, target, overrides=sums,
                          written_first=tuple(o.name for o in self.writes))
        self._q_lanes = None  # the query tile's row and head-dim conditions (`_body`)
        self.name = kernel_name("attention", region)
        self.loop_loads = 0  # the most [BLOCK_N, D] tiles a key step loads
        self.mask_loads = 0
        self.three_d = len(_shape(region, plan, shape.q)) == 3

    def _row_sum_at(self, op):
        """A folded head-dim sum (dispatch/fold_query_norm.py) at a query row: the summed
        value read at the tile's head-dim lanes `dq`, summed across them ([BLOCK_M, 1]).
        Only where the query tile is loaded (its rows and head dim, never a key's)."""
        src = head_dim_sum(op)
        if src is None:
            raise CodegenUnsupported(f"a reduction ({op.target}) in the attention's prologue "
                                     "that is not a sum over the head dim")

        def at(index):
            em, d = self.em, self.s.head_dim
            keyed = {"nk", "dk", "nv", "dv2", "dq"}
            if (self._q_lanes is None or Lin.of(index[-1]).var_names()
                    or any(keyed & Lin.of(i).var_names() for i in index[:-1])):
                return None
            if em.shape(src.name)[-1] != d:
                return None
            rows, lanes = self._q_lanes
            v = em.value(src.name, tuple(index[:-1]) + (Lin.of(Var("dq", d)),),
                         mask_of(rows, lanes))
            if "dq" not in v.vars:
                return None
            x = em.cast(v, torch.float32).code
            if lanes is not None:
                x = f"tl.where({lanes.code}, {x}, 0.0)"
            total = f"tl.sum({x}, 1)[:, None]"
            if op.target == "aten.mean.dim":
                total = f"{total} / {d}"
            out = em.let(total, torch.float32, v.vars - {"dq"})
            return em.cast(out, op.dtype)
        return at

    # indices ------------------------------------------------------------------
    def _index(self, name: str, role: str, head: Lin, row: Lin, col: Lin, feature: Lin):
        """Index into operand `name` at the tile's variables.

        The attention's coordinates are (batch, head, query row, key col, feature):
        Q is read at (b, h, row, e), K and V at (b, h_kv, col, e), the mask at
        (b, h, row, col); 3-d operands have no head dim, a mask may have fewer leading
        dims, and size-1 dims broadcast.
        """
        shape = _shape(self.region, self.plan, name)
        b = Lin.of(Var("b", self.s.batch, block=False))
        pos = row if role == "q" else col
        dims = {"q": (b, head, row, feature), "k": (b, head, col, feature),
                "v": (b, head, col, feature), "mask": (b, head, row, col)}[role]
        if self.three_d:
            dims = (b, row, col) if role == "mask" else (b, pos, feature)
        dims = dims[len(dims) - len(shape):]
        return tuple(Lin() if same_dim(n, 1) else i for i, n in zip(dims, shape))

    def _head(self) -> Lin:
        s = self.s
        rows = Lin.of(Var("rows2", s.group * s.tq))
        return Lin.of(Var("kvh", s.kv_heads, block=False)) * s.group + floordiv(rows, s.tq)

    def _query_pos(self) -> Lin:
        return modidx(Lin.of(Var("rows2", self.s.group * self.s.tq)), 1, self.s.tq)

    def _cast(self, name: str, vars_: set) -> tuple[list[str], str]:
        """fp32 `name` in the operands' dtype, rounded as the GPU rounds (emitter's cast)."""
        with self.em.block() as lines:
            v = self.em.cast(Val(name, torch.float32, frozenset(vars_)), self.s.dtype)
        return lines, v.code

    def _op(self, code: str) -> str:
        return dot_operand(code, self.s.dtype, self.em.target)

    def _load(self, name: str, index, mask, tile: str | None = None,
              pad: Cond | None = None) -> tuple[list[str], str]:
        """The value's loading lines and code; with `tile` ("[BLOCK_M, 16]"), a load whose
        index lacks a tile dim (a size-1 head dim or length, read at 0, or a constant) is
        broadcast to it: tl.dot takes only full 2-D tiles. `pad` (dq < d) zeroes the
        padded head-dim lanes the broadcast filled."""
        dims = {"q": {"rows2", "dq"}, "k": {"dk", "nk"}, "v": {"nv", "dv2"}}
        which = {self.s.q: "q", self.s.k: "k", self.s.v: "v"}.get(name)
        with self.em.block() as lines:
            v = self.em.value(name, index, mask)
            broadcast = tile is not None and which is not None and not dims[which] <= v.vars
            if broadcast:  # a constant operand (ones_like keys) is a literal: make it a tensor
                v = self.em.tensor(v)
        if broadcast:
            full = f"tl.broadcast_to({v.code}, {tile})"
            return lines, (f"tl.where({pad.code}, {full}, 0)" if pad is not None else full)
        return lines, v.code

    # source ---------------------------------------------------------------------
    def spec(self) -> KernelSpec:
        s, p, target = self.s, self.p, self.em.target
        for v in list(self.region.inputs) + list(self.region.outputs):
            p.check_extent(self.plan.values[v].numel)
        rows = s.group * s.tq
        tiles = f"cdiv({p.grid(rows)}, BLOCK_M)"
        heads = p.grid(s.batch * s.kv_heads)
        all_tiles = f"{tiles} * {heads}"
        rows_hi = bounds_of(rows, self.plan.symbols).hi
        decode = rows_hi is not None and rows_hi <= 16
        sms = target.multiprocessors
        fill = (f"{sms} if {sms} // max(1, {all_tiles}) >= {FEW_SPLITS} else "
                f"{sms * DECODE_PROGRAMS_PER_SM}") if decode else str(sms)
        n_split = split.count("KV_SPLIT", all_tiles, fill,
                              f"cdiv({p.grid(s.s)}, {MIN_SPLIT_BLOCKS} * BLOCK_N)")
        body = self._body()
        tunables = ["BLOCK_M", "BLOCK_N", "KV_SPLIT"]
        params = p.names() + [split.PARTS, split.COUNTS] + [f"{t}: tl.constexpr"
                                                              for t in tunables]
        source = module_source(self.name, params, body, self.em.helpers, target,
                               p.describe())
        dvp = _pow2(s.value_dim)
        default = heuristic(s, rows_hi, target)
        configs = [c for c in config_space(s, rows_hi) if not miscompiled(c, dvp, target)]
        if default not in configs:
            configs.insert(0, default)
        meta = {"head_dim": s.head_dim, "value_dim": s.value_dim, "group": s.group,
                "dtype": str(s.dtype).replace("torch.", ""), "causal": s.causal,
                "mask": s.mask_kind, "head_dim_pad": _pow2(max(s.head_dim, s.value_dim)),
                # [BLOCK_N, D] tiles the key loop loads beyond K and V (fused prologues)
                "prologue_tiles": max(0, self.loop_loads - 2),
                "mask_tiles": self.mask_loads, "key_bounds": s.key_bounds is not None}
        if s.key_bounds is not None:  # time (and check) the whole walk, not an empty one
            # every key live and plain: the mask-free walk a causal mask takes
            meta["timing_fill"] = {b: v for b, v in zip(s.key_bounds, ("0", to_str(s.s),
                                                                     to_str(s.s))) if b}
        return KernelSpec(self.name, source, p.args(), tunables, (tiles, heads, n_split),
                          configs, default, "attention", meta, 64 if p.needs_int64 else 32,
                          scratch=split.scratch(all_tiles, n_split, f"BLOCK_M * {dvp + 2}"))

    def _body(self) -> list[str]:
        s, p = self.s, self.p
        d, dv = s.head_dim, s.value_dim
        dp, dvp = _pow2(d), _pow2(dv)
        tq, slen = p.dim(s.tq), p.dim(s.s)
        wide = ".to(tl.int64)" if p.needs_int64 else ""
        ieee = ', input_precision="ieee"' if s.dtype == torch.float32 else ""
        out = self.region.outputs[0]
        o = self.out_ptr = p.tensor(out, s.dtype, self.plan.values[out].shape, output=True,
                                    name="out_ptr")
        for w in self.writes:  # written, then read: an output of the kernel
            p.tensor(w.name, w.dtype, self.plan.values[w.name].shape, output=True)
        # causal, or a mask with an envelope (a causal mask read from a buffer, whose
        # row spans grow with the row): the longest row blocks (the last) start first,
        # so they do not trail
        longest_last = s.causal or s.key_bounds is not None
        first = "tl.num_programs(0) - 1 - tl.program_id(0)" if longest_last else \
            "tl.program_id(0)"
        L = [
            f"pid_m = {first}",
            f"pid_z = tl.program_id(1){wide}",
            "pid_s = tl.program_id(2)",
            "n_split = tl.num_programs(2)",
            f"b = pid_z // {s.kv_heads}",
            f"kvh = pid_z % {s.kv_heads}",
            f"rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M){wide}",
            "rows2 = rows[:, None]",
            f"head = kvh * {s.group} + rows // {tq}",
            f"qi = rows % {tq}",
            f"row_ok = rows < {s.group} * {tq}",
            "row_ok2 = row_ok[:, None]",
            f"dq = tl.arange(0, {dp})[None, :]",
            f"dk = tl.arange(0, {dp})[:, None]",
            f"dv2 = tl.arange(0, {dvp})[None, :]",
        ]
        head, qpos = self._head(), self._query_pos()
        rows_c = Cond("row_ok2", frozenset({"rows2"}))
        dq_c = Cond(f"dq < {d}", frozenset({"dq"})) if d != dp else None
        self._q_lanes = (rows_c, dq_c)
        q_lines, q = self._load(s.q, self._index(s.q, "q", head, qpos, Lin(), Lin.of(Var("dq", d))),
                                mask_of(rows_c, dq_c), tile=f"[BLOCK_M, {dp}]", pad=dq_c)
        self._q_lanes = None  # a folded head-dim sum is the query's alone
        row_lines, stores = self._cache_writes()
        L += q_lines + row_lines + [
            f"q = {q}",
            *self._score_scale(),
            'm_i = tl.full([BLOCK_M], float("-inf"), tl.float32)',
            "l_i = tl.zeros([BLOCK_M], tl.float32)",
            f"acc = tl.zeros([BLOCK_M, {dvp}], tl.float32)",
        ]
        # keys [0, kv_end) matter; blocks before full_end need no key or causal mask
        if s.causal:
            L += [f"kv_end = tl.minimum({slen}, tl.max(tl.where(row_ok, qi, 0)) + 1)",
                  f"full_end = tl.minimum({slen}, tl.min(tl.where(row_ok, qi, {slen})) + 1)"
                  " // BLOCK_N * BLOCK_N"]
        else:
            L += [f"kv_end = {slen}", f"full_end = {slen} // BLOCK_N * BLOCK_N"]
        kv_start = "0"
        if s.key_bounds is not None:
            L += self._envelope(head, qpos, slen)
            kv_start = "kv_start"
        # a loop-invariant load (the query position a causal mask compares with) is
        # read once; a decode tile (16 rows at most: q's parts are small) issues every
        # load of the prologue as early as it can
        # a mask plain by its form (a prefix of the keys a row: dispatch/prefix_mask.py,
        # key_bounds without a `plain` count) is never loaded: no mask loops
        always_plain = s.key_bounds is not None and s.key_bounds[2] is None
        steps = [] if always_plain else [(True, "mask"), (False, "mask")]
        if s.key_bounds is not None:  # a plain envelope's edges and inside
            steps += [(False, "bounds"), (True, "none")]
        loops = [self._key_step(head, qpos, dp, dvp, ieee, wide, full, source)
                 for full, source in steps]
        for i, body in enumerate(loops):
            hoisted, loops[i] = load_order.invariant_loads(body, {"start_n"})
            L += hoisted
        rows_hi = bounds_of(s.group * s.tq, self.plan.symbols).hi
        if rows_hi is not None and rows_hi <= 16:
            L = load_order.loads_first(L)
        # a prompt tile with an envelope narrows its split to the keys it reaches (a
        # decode tile's `_combine` reads only the parts with keys: n_used)
        live = s.key_bounds is not None and (rows_hi is None or rows_hi > 16)
        self._splits = "n_live" if live else "n_split"
        L += [f"lo = {kv_start}", "hi = kv_end", "if KV_SPLIT > 1:",
              *(["    " + x for x in _live_splits(kv_start)] if live else []),
              *["    " + x for x in split.program_range("kv_end", "BLOCK_N", kv_start,
                                                      self._splits)],
              "mid = tl.minimum(hi, tl.maximum(lo, full_end))"]
        L += [line.replace("{kv_start}", kv_start) for line in stores]
        if s.key_bounds is None:
            L += [*_loop("lo", "mid", loops[0]), *_loop("mid", "hi", loops[1])]
        elif always_plain:  # every tile plain: the edges compared with the rows' bounds
            L += ["in_a = tl.minimum(hi, tl.maximum(lo, in_lo))",
                  "in_b = tl.minimum(hi, tl.maximum(in_a, in_hi))",
                  *_loop("lo", "in_a", loops[0]), *_loop("in_a", "in_b", loops[1]),
                  *_loop("in_b", "hi", loops[0])]
        else:  # the mask is read only where it says more than its envelope
            # the plain loops are empty in a tile that is not plain (by their bounds);
            # the mask's loops run only in such a tile: an `if` around loops, not loads
            # (each still pipelines), so a plain tile (causal, decode) skips their
            # pipeline prologues. (As if / else branches both sets' pipeline buffers
            # were held at once on sm_90: shared 147 -> 229 KB, 10 words spilled with
            # q's RoPE in the prologue.) A split past the keys has hi < lo: every
            # range is empty there.
            L += ["in_a = tl.where(plain, tl.minimum(hi, tl.maximum(lo, in_lo)), lo)",
                  "in_b = tl.where(plain, tl.minimum(hi, tl.maximum(in_a, in_hi)), lo)",
                  "edge_b = tl.where(plain, in_b, hi)",
                  *_loop("lo", "in_a", loops[2]), *_loop("in_a", "in_b", loops[3]),
                  *_loop("edge_b", "hi", loops[2]),
                  "if not plain:",
                  *_loop("lo", "mid", loops[0], 1), *_loop("mid", "hi", loops[1], 1)]
        L += self._combine(dvp, p.dim(s.group * s.tq))
        out_lines, out_code = self._cast("acc", {"rows2", "dv2"})
        L += [
            "acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]",  # fully masked rows: 0
            *out_lines,
            f"ooff = ((b * {s.heads} + head[:, None]) * {tq} + qi[:, None]) * {dv} + dv2",
            f"tl.store({o} + ooff, {out_code}, mask=row_ok2 & (dv2 < {dv}))",
        ]
        return L

    def _cache_writes(self) -> tuple[list[str], list[str]]:
        """The folded cache writes (dispatch/fold_cache_writes.py): lines computing the
        tile's new key and value rows (in the prologue: their loads go out with q's),
        and lines storing them (after the split's key range is known, templates
        "{kv_start}" filled in). The program whose keys hold the written position
        stores the row and then reads it; no other program reads that row. A row no
        program reads (past the tile's keys) is stored by the tile's first split."""
        if not self.writes:
            return [], []
        s = self.s
        rows_hi = bounds_of(s.group * s.tq, self.plan.symbols).hi
        if rows_hi is None or rows_hi > 16 or not same_dim(s.tq, 1):
            raise CodegenUnsupported("cache writes folded into a prompt's attention")
        kvh = Lin.of(Var("kvh", s.kv_heads, block=False)) * s.kv_repeat
        reads = {}
        for name, role, key, lane, size in ((s.k, "k", "nk", "dq", s.head_dim),
                                            (s.v, "v", "nv", "dv2", s.value_dim)):
            index = self._index(name, role, kvh, Lin(), Lin.of(Var(key, s.s)),
                                Lin.of(Var(lane, size)))
            src, index = self._behind_views(name, index)
            reads[src] = (index, key, lane, size)
        rows, stores = [], []
        for n, op in enumerate(self.writes):
            if op.name not in reads:
                raise CodegenUnsupported(f"a folded cache write (%{op.name}) the attention "
                                         "reads as neither its keys nor its values")
            index, key, lane, size = reads[op.name]
            at = [i for i, x in enumerate(index) if key in Lin.of(x).var_names()]
            if len(at) != 1 or not Lin.of(index[at[0]]).equals(Lin.of(Var(key, s.s))):
                raise CodegenUnsupported(f"a cache write (%{op.name}) along another dim than "
                                         "the attention's keys")
            axis = at[0]
            update = update_shape(self.em, op)
            if not same_dim(update[axis], 1):
                raise CodegenUnsupported(f"a cache write (%{op.name}) of several rows")
            u = tuple(Lin() if i == axis else Lin.of(x) for i, x in enumerate(index))
            lanes = Cond(f"{lane} < {size}", frozenset({lane})) \
                if size != _pow2(size) else None
            with self.em.block() as lines:
                dest, value, accumulate = destination(self.em, op, u, update, mask_of(lanes))
            if accumulate or any(not Lin.of(d).equals(x) for i, (d, x) in
                                 enumerate(zip(dest, u)) if i != axis) \
                    or Lin.of(dest[axis]).var_names() & {lane}:
                raise CodegenUnsupported(f"a cache write (%{op.name}) whose rows are not the "
                                         "tile's own")
            rows += lines + [f"wpos{n} = {self.em.code(dest[axis])}"]
            with self.em.block() as lines:
                self.em.store(op.name, dest, value, mask_of(lanes, Cond(f"writer{n}")),
                              span=(lane,))
            stores += [
                # the split reading the row, or (no split reads it) the first
                f"writer{n} = ((wpos{n} >= lo) & (wpos{n} < hi)) | ((pid_s == 0) & "
                f"((wpos{n} < {{kv_start}}) | (wpos{n} >= kv_end)))",
                *lines]
        return rows, stores + ["tl.debug_barrier()  # the row stored before any load of it"]

    def _behind_views(self, name: str, index):
        """(value, index): operand `name` at `index`, seen back through its views."""
        ops = {o.name: o for o in self.region.ops}
        while name in ops and is_view(ops[name], ops):
            name, index = source_index(ops[name], index,
                                       lambda n: _shape(self.region, self.plan, n), ops)
        return name, index

    def _score_scale(self) -> list[str]:
        """The scores' factor into base 2; with a softcap, the factor of the tanh's
        exp2 argument (2 scale / cap in base 2) and the cap in base 2."""
        s = self.s
        if s.softcap is None:
            return [f"qk_scale = {s.scale * LOG2E!r}"]
        return [f"qk_scale = {2.0 * s.scale / s.softcap * LOG2E!r}",
                f"cap2 = {s.softcap * LOG2E!r}"]

    def _envelope(self, head: Lin, qpos: Lin, slen: str) -> list[str]:
        """Lines narrowing [kv_start, kv_end) to the keys the tile's rows' mask lets
        through, read from the envelope (three int32 values per mask row). kv_start is
        block-aligned, so the blocks up to full_end stay wholly inside the keys. A tile
        whose rows let nothing through gets an empty range: its rows give 0, as eager.
        `plain`: every row passes exactly its span's keys, unbiased, and the spans meet
        (none starts after another ends; a row that passes nothing meets none), so the
        keys some row passes are one run, [hull_lo, hull_hi); then [in_lo, in_hi)
        (block-aligned) are the keys inside every row's span."""
        start, end, plain = self.s.key_bounds
        shape = _shape(self.region, self.plan, start)
        b = Lin.of(Var("b", self.s.batch, block=False))
        dims = (b, qpos) if self.three_d else (b, head, qpos)
        dims = dims[len(dims) - len(shape):]
        index = tuple(Lin() if same_dim(n, 1) else i for i, n in zip(dims, shape))
        rows = Cond("row_ok2", frozenset({"rows2"}))
        with self.em.block() as lines:
            first = self.em.value(start, index, mask_of(rows)).code
            last = self.em.value(end, index, mask_of(rows)).code
            passed = None if plain is None else self.em.value(plain, index,
                                                               mask_of(rows)).code
        plain_lines = [] if passed is None else [
            f"plain = (tl.min(tl.where(row_ok2, ({passed} >= key_hi - key_lo).to(tl.int32), 1))"
            " > 0) & (span_lo <= span_hi)"]
        return lines + [
            f"key_lo = {first}",
            f"key_hi = {last}",
            "kv_end = tl.minimum(kv_end, tl.max(tl.where(row_ok2, key_hi, 0)))",
            f"kv_start = tl.minimum(tl.min(tl.where(row_ok2, key_lo, {slen})), kv_end)"
            " // BLOCK_N * BLOCK_N",
            # the keys in every row's span; the keys in some row's span (one run when
            # the spans meet: then a key's V row is read where some row passes it)
            "span_lo = tl.max(tl.where(row_ok2, key_lo, 0))",
            f"span_hi = tl.min(tl.where(row_ok2, key_hi, {slen}))",
            f"hull_lo = tl.min(tl.where(row_ok2, key_lo, {slen}))",
            "hull_hi = tl.max(tl.where(row_ok2, key_hi, 0))",
            *plain_lines,
            "in_lo = tl.cdiv(span_lo, BLOCK_N) * BLOCK_N",
            "in_hi = span_hi // BLOCK_N * BLOCK_N",
        ]

    def _combine(self, dvp: int, rows: str) -> list[str]:
        """With the keys split: each part with keys stores its unnormalised acc, running
        max and sum; the last program to arrive merges the parts that had keys (parts
        past the keys are left unread) and stores the output. Every part's max and sum
        come in one [KV_SPLIT, rows] load each, so each part's weight is known before
        its acc is read: the acc loads depend on nothing and go split.UNROLL at a time.
        The merge holds only the rows a tile can have (a decode tile's GQA group: 8 of
        its 16), not BLOCK_M: half the registers, so a 256-wide head still merges 4
        parts a step (32 parts one after another, each an L2 round trip, took ~15 us
        of a 26 us decode attention at head dim 256). The others store nothing. (Its
        names differ from the key loop's m_i, l_i, which are BLOCK_M wide.) Tiles
        of more than 16 rows (prefill) merge as before (`_combine_running`): their
        [KV_SPLIT, BLOCK_M] maxima and sums beside the accumulator spilled at 128 rows."""
        s = self.s
        numel = f"BLOCK_M * {dvp + 2}"
        acc_at = "ar[:, None] * " + str(dvp) + " + tl.arange(0, " + str(dvp) + ")[None, :]"
        m_at, l_at = f"BLOCK_M * {dvp} + ar", f"BLOCK_M * {dvp + 1} + ar"
        store = ["ar = tl.arange(0, BLOCK_M)",  # rows past the group's are never used
                 "if lo < hi:",
                 f"    tl.store({split.part(numel)} + {acc_at}, acc, mask=row_ok2)",
                 f"    tl.store({split.part(numel)} + {m_at}, m_i, mask=row_ok)",
                 f"    tl.store({split.part(numel)} + {l_at}, l_i, mask=row_ok)"]
        hi = bounds_of(s.group * s.tq, self.plan.symbols).hi
        if hi is None or hi > 16:
            return self._combine_running(dvp, rows)
        mr = max(2, 1 << (hi - 1).bit_length())  # no tl.dot here: any power of two
        tq = self.p.dim(s.tq)
        sp = "tl.arange(0, KV_SPLIT)[:, None]"
        every = f"{split.PARTS} + (tile_id * n_split + {sp}) * ({numel})"
        on = f"({sp} < n_used) & mr_ok[None, :]"
        part = split.part(numel, "s")
        used = "(s < n_used)"
        m_s = split.load_part(f"{part} + BLOCK_M * {dvp} + mr", f"mr_ok & {used}",
                              'float("-inf")')
        a_s = split.load_part(f"{part} + mr[:, None] * {dvp} + dv2",
                              f"(mr_ok & {used})[:, None]")
        out_lines, out_code = self._cast("o", {"mr2", "dv2"})
        start = "kv_start" if s.key_bounds is not None else "0"
        m_all = split.load_part(f"{every} + BLOCK_M * {dvp} + mr[None, :]", on,
                                'float("-inf")')
        l_all = split.load_part(f"{every} + BLOCK_M * {dvp + 1} + mr[None, :]", on)
        combine = [
            f"mr = tl.arange(0, {mr})",
            f"mr_ok = pid_m * BLOCK_M + mr < {rows}",
            "mr2 = mr[:, None]",
            f"n_used = tl.cdiv(kv_end - {start}, tl.maximum(per_split, 1))",
            f"m_all = {m_all}",
            "m_top = tl.max(m_all, 0)",
            'm_ref = tl.where(m_top == float("-inf"), 0.0, m_top)',
            f"l_sum = tl.sum({l_all} * tl.exp2(m_all - m_ref[None, :]), 0)",
            "l_inv = 1.0 / tl.where(l_sum == 0.0, 1.0, l_sum)",  # fully masked rows: 0
            f"o = tl.zeros([{mr}, {dvp}], tl.float32)",
            *split.merge_loop(f"{mr} * {dvp}", [
                f"w = tl.exp2({m_s} - m_ref) * l_inv",
                f"o += {a_s} * w[:, None]"], count="n_used"),
            *out_lines,
            "mrow = pid_m * BLOCK_M + mr2",
            f"ooff = ((b * {s.heads} + kvh * {s.group} + mrow // {tq}) * {tq} + "
            f"mrow % {tq}) * {s.value_dim} + dv2",
            f"tl.store({self.out_ptr} + ooff, {out_code}, "
            f"mask=mr_ok[:, None] & (dv2 < {s.value_dim}))",
        ]
        gate = ["row_ok2 = row_ok2 & (n_split == 1)"]  # a split's output: the merge's
        return split.arrive("KV_SPLIT", "pid_z * tl.num_programs(0) + pid_m", store, combine,
                            gate)

    def _combine_running(self, dvp: int, rows: str) -> list[str]:
        """With the keys split, tiles of many rows (`_combine` says why few differ):
        store this part (unnormalised acc, running max and sum); the last program
        merges all parts by their maxima, and alone stores."""
        numel = f"BLOCK_M * {dvp + 2}"
        acc_at = "ar[:, None] * " + str(dvp) + " + tl.arange(0, " + str(dvp) + ")[None, :]"
        m_at, l_at = f"BLOCK_M * {dvp} + ar", f"BLOCK_M * {dvp + 1} + ar"
        store = ["ar = tl.arange(0, BLOCK_M)",  # rows past the group's are never used
                 f"tl.store({split.part(numel)} + {acc_at}, acc, mask=row_ok2)",
                 f"tl.store({split.part(numel)} + {m_at}, m_i, mask=row_ok)",
                 f"tl.store({split.part(numel)} + {l_at}, l_i, mask=row_ok)"]
        # one pass over the parts, merging each by its maximum
        part = split.part(numel, "s")
        live = self._splits
        ok = f"row_ok & (s < {live})"
        m_s = split.load_part(f"{part} + {m_at}", ok, 'float("-inf")')
        l_s = split.load_part(f"{part} + {l_at}", ok)
        a_s = split.load_part(f"{part} + {acc_at}", f"({ok})[:, None]")
        combine = [
            'm_i = tl.full([BLOCK_M], float("-inf"), tl.float32)',
            "l_i = tl.zeros([BLOCK_M], tl.float32)",
            f"acc = tl.zeros([BLOCK_M, {dvp}], tl.float32)",
            *split.merge_loop(f"BLOCK_M * {dvp}", [
                f"m_s = {m_s}", f"l_s = {l_s}", f"a_s = {a_s}",
                "m_new = tl.maximum(m_i, m_s)",
                'm_use = tl.where(m_new == float("-inf"), 0.0, m_new)',
                "alpha = tl.exp2(m_i - m_use)",
                "beta = tl.exp2(m_s - m_use)",
                "l_i = l_i * alpha + l_s * beta",
                "acc = acc * alpha[:, None] + a_s * beta[:, None]",
                "m_i = m_new"], count=live),
        ]
        gate = [f"row_ok2 = rows2 < tl.where(last, {rows}, 0)"]  # only the last stores
        return split.arrive("KV_SPLIT", "pid_z * tl.num_programs(0) + pid_m", store, combine,
                            gate, live=live)


    def _key_step(self, head, qpos, dp, dvp, ieee, wide, full: bool,
                  source: str = "mask") -> list[str]:
        """One BLOCK_N step of the key loop. A `full` step's keys are all in range and,
        if causal, at or before every row's query: no key, row or causal masks.
        `source`, where an explicit mask's verdict comes from: "mask" (its tile, loaded),
        "bounds" (key j passes row r when key_lo[r] <= j < key_hi[r]: a plain
        envelope's, `_envelope`) or "none" (keys every row passes: no mask)."""
        s, p = self.s, self.p
        d, dv, slen = s.head_dim, s.value_dim, p.dim(s.s)
        kvh = Lin.of(Var("kvh", s.kv_heads, block=False)) * s.kv_repeat  # K/V's head
        nk_c = None if full else Cond("nk_ok", frozenset({"nk"}))
        nv_c = None if full else Cond("nv_ok", frozenset({"nv"}))
        dk_c = Cond(f"dk < {d}", frozenset({"dk"})) if d != dp else None
        dv_c = Cond(f"dv2 < {dv}", frozenset({"dv2"})) if dv != dvp else None
        k_idx = self._index(s.k, "k", kvh, Lin(), Lin.of(Var("nk", s.s)), Lin.of(Var("dk", d)))
        v_idx = self._index(s.v, "v", kvh, Lin(), Lin.of(Var("nv", s.s)),
                            Lin.of(Var("dv2", dv)))
        # keys no row of the mask lets through are not read: a decode step over a
        # static cache reads only the context's keys, whatever the cache's length
        m_lines, m, live = [], None, []
        v_in = []  # a plain envelope's keys: V read only where some row passes the key
        if s.mask is not None and source == "bounds":
            m_lines = ["key_in = (nk >= key_lo) & (nk < key_hi)",
                       "v_in = (nv >= hull_lo) & (nv < hull_hi)"]
            v_in = [Cond("v_in", frozenset({"nv"}))]
        elif s.mask is not None and source == "mask":
            idx = self._index(s.mask, "mask", head, qpos, Lin.of(Var("nk", s.s)), Lin())
            m_lines, m = self._load(s.mask, idx, mask_of(Cond("row_ok2", frozenset({"rows2"})),
                                                         nk_c))
            self.mask_loads = sum("tl.load(" in x for x in m_lines)
            lets = f"({m} != 0)" if s.mask_kind == "bool" else \
                f'({m}.to(tl.float32) != float("-inf"))'
            m_lines += [f"key_live = tl.max(tl.where(row_ok2, {lets}, False).to(tl.int32), 0) > 0",
                        "live_k = key_live[None, :]", "live_v = key_live[:, None]"]
            live = [Cond("live_k", frozenset({"nk"})), Cond("live_v", frozenset({"nv"}))]
        # With the mask's envelope the loop's keys are already the live range's, so a
        # dead key inside it is rare: its K and V are read (an unmasked load the
        # pipeliner issues ahead, not one waiting on this step's mask), its score set
        # to -inf and its V row to 0, so a never-written cache row (NaN) stays out
        enveloped = bool(live) and s.key_bounds is not None
        load_live = [] if enveloped else live
        k_lines, kt = self._load(s.k, k_idx, mask_of(nk_c, dk_c, *load_live[:1]),
                                 tile=f"[{dp}, BLOCK_N]", pad=dk_c)
        v_lines, vt = self._load(s.v, v_idx, mask_of(nv_c, dv_c, *load_live[1:]),
                                 tile=f"[BLOCK_N, {dvp}]", pad=dv_c)
        if enveloped:
            vt = f"tl.where(live_v, {vt}, 0.0)"
        elif v_in:
            vt = f"tl.where(v_in, {vt}, 0.0)"
        self.loop_loads = max(self.loop_loads, sum("tl.load(" in x for x in k_lines + v_lines))
        p_lines, p_code = self._cast("pr", {"rows2", "nk"})
        L = [f"n = start_n + tl.arange(0, BLOCK_N){wide}", "nk = n[None, :]", "nv = n[:, None]"]
        if not full:
            L += [f"nk_ok = nk < {slen}", f"nv_ok = nv < {slen}"]
        L += [*m_lines, *k_lines,
              f"qk = tl.dot({self._op('q')}, {self._op(kt)}{ieee}, out_dtype=tl.float32)"]
        conds = [] if full else ["nk_ok", "row_ok2"]
        if s.causal and not full:
            conds.append("(nk <= qi[:, None])")
        score = "qk * qk_scale"
        if s.softcap is not None:
            # cap * tanh(t), t = qk * scale / cap, in base 2: tanh(t) = 1 - 2 / (e^2t + 1),
            # one exp2 (+-cap at either end, no overflow to NaN)
            L.append("qk = cap2 - 2.0 * cap2 / (tl.exp2(qk * qk_scale) + 1.0)")
            score = "qk"
        if source == "bounds":
            conds.append("key_in")
        elif m is not None:
            if s.mask_kind == "bool":
                conds.append(f"({m} != 0)")
            else:
                # a finite mask value stays finite in base 2: transformers' padding
                # mask is finfo.min, and a row of it alone (a padded query) is
                # uniform over its keys in eager, not empty (0) as -inf would make it
                mf = f"{m}.to(tl.float32)"
                score = (f'{score} + tl.where({mf} == float("-inf"), {mf}, '
                         f"tl.maximum({mf} * {LOG2E!r}, {-FLT32_MAX!r}))")
                if enveloped:  # a NaN key's score is not -inf + NaN
                    conds.append("live_k")
        if conds:
            L.append(f'sc = tl.where({" & ".join(conds)}, {score}, float("-inf"))')
        else:
            L.append(f"sc = {score}")
        L += [
            "m_new = tl.maximum(m_i, tl.max(sc, 1))",
            'm_use = tl.where(m_new == float("-inf"), 0.0, m_new)',
            "pr = tl.exp2(sc - m_use[:, None])",
            "alpha = tl.exp2(m_i - m_use)",
            "l_i = l_i * alpha + tl.sum(pr, 1)",
            *v_lines,
            f"vt = {vt}",
            *p_lines,
            f"acc = tl.dot({self._op(p_code)}, {self._op('vt')}, "
            f"acc * alpha[:, None]{ieee}, out_dtype=tl.float32)",
            "m_i = m_new",
        ]
        return L
