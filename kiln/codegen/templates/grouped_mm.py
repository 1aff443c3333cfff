"""A grouped GEMM by offsets: rows sorted by expert, each multiplied by its expert's matrix.

out[r] = x[r] @ w[e(r)] for x [S, K] whose rows are grouped by expert, w [E, K, N], and
offs [E] the cumulative row counts (expert e owns rows offs[e-1] .. offs[e]); rows past
offs[E-1] belong to no expert and are zero. It is what transformers 5's MoE layers
(OLMoE, Qwen2/3-MoE, GPT-OSS, Mixtral, DeepSeek-V2, ...) run their experts through:
`transformers::grouped_mm_fallback`, a Python loop over the experts behind an
`offs.tolist()` host sync, or `aten._grouped_mm` (the same contract, in bf16 on a
GPU); kiln had run both as PyTorch's ops.

A prompt's row tiles are cut per expert (as cuBLAS's grouped GEMM does): expert e's
rows make cdiv(rows_e, BLOCK_M) tiles of their own, so each program runs one K loop
against one matrix. Tiles over the rows as they come would straddle experts, each
straddling tile running its K loop once per expert (MoE experts of ~100 rows: nearly
every tile, twice the products; 0.84x cuBLAS on the H200 at Qwen3-MoE's widths). The
grid allows cdiv(S, BLOCK_M) + E row tiles, the most any offsets need (rows in no
expert take zero tiles after the experts'); programs past the last do nothing.
A decode step's few rows (up to SPREAD_ROWS) may each be an expert of their own, so
there each expert whose rows start in the tile gets a program of its own (grid axis
1: one per row of the tile), storing its own rows: as many programs read weights at
once as the step has experts. fp32 operands take exact ("ieee") products, as the
matmul template's do.
"""

from __future__ import annotations

import torch

from kiln.codegen.build.spec import Config, KernelSpec
from kiln.codegen.expr.emit import kernel_name, module_source
from kiln.codegen.expr.kernel_args import SymbolicArgs
from kiln.codegen.expr.values import CodegenUnsupported
from kiln.codegen.templates.matmul import configs as matmul_configs
from kiln.codegen.templates.matmul.template import dot_operand
from kiln.codegen.templates.op_operands import operand_dtype as _dtype
from kiln.codegen.templates.op_operands import operand_shape as _shape
from kiln.ir.plan import DispatchPlan, Ref, Region
from kiln.ir.symbolic import bounds_of
from kiln.target import Target

OPS = ("transformers.grouped_mm_fallback.default", "aten._grouped_mm.default")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int32, torch.int64)
_TL = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32"}
MAX_EXPERTS = 1024  # offs is read as one block


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def analyse(region: Region, plan: DispatchPlan) -> tuple:
    """(x, w, offs, out, S, K, N, E, dtype); raises CodegenUnsupported saying why not."""
    anchor = region.anchor()
    if anchor.target not in OPS:
        raise CodegenUnsupported(f"{anchor.target} is not a grouped GEMM by offsets")
    args = list(anchor.args) + [None] * 5
    x, w, offs = args[:3]
    extra = [a for a in args[3:5] if a is not None] + [
        v for k, v in anchor.kwargs.items() if k in ("bias", "out_dtype") and v is not None]
    if extra:
        raise CodegenUnsupported("a grouped GEMM with a bias or an output dtype of its own")
    w, transposed = _weight(region, w)
    for what, a in (("input", x), ("weight", w), ("offs", offs)):
        if not isinstance(a, Ref) or a.name not in region.inputs:
            raise CodegenUnsupported(f"its {what} is not a stored tensor (the kernel reads "
                                     "each operand in place)")
    if any(op.name != anchor.name and (not transposed or op.target != _PERMUTE)
           for op in region.ops):
        raise CodegenUnsupported("ops besides the grouped GEMM and its weight's transpose")
    if region.outputs != [anchor.name]:
        raise CodegenUnsupported(f"the region outputs {region.outputs}, not only the op's")
    xs, ws, os_ = (_shape(region, plan, a.name) for a in (x, w, offs))
    if transposed:  # stored [E, N, K], as nn.Linear keeps a weight
        ws = (ws[0], ws[2], ws[1]) if len(ws) == 3 else ws
    if len(xs) != 2 or len(ws) != 3 or len(os_) != 1:
        raise CodegenUnsupported(f"operands of shapes {xs}, {ws}, {os_}: not the 2D x 3D form")
    E, K, N = ws
    if not all(isinstance(d, int) for d in (E, K, N)) or xs[1] != K or os_[0] != E:
        raise CodegenUnsupported(f"operands of shapes {xs}, {ws}, {os_} that do not agree")
    if E > MAX_EXPERTS:
        raise CodegenUnsupported(f"{E} experts (at most {MAX_EXPERTS})")
    dtype = _dtype(region, plan, x.name)
    if dtype not in _FLOATS or _dtype(region, plan, w.name) != dtype or \
            _dtype(region, plan, offs.name) not in _INTS or anchor.dtype != dtype:
        raise CodegenUnsupported("operands of other dtypes than one float dtype and "
                                 "integer offsets")
    return x.name, w.name, offs.name, anchor.name, xs[0], K, N, E, dtype, transposed


_PERMUTE = "aten.permute.default"


def _weight(region: Region, w) -> tuple:
    """(the stored weight's Ref, whether the op reads it transposed): transformers'
    experts keep [E, out, in] and pass `weight.transpose(1, 2)`, a permute in the
    region that the kernel reads through (w[e, k, n] at e * N * K + n * K + k)."""
    if not isinstance(w, Ref) or w.name in region.inputs:
        return w, False
    op = next((o for o in region.ops if o.name == w.name), None)
    if op is None or op.target != _PERMUTE or list(op.args[1]) not in ([0, 2, 1], [0, -1, -2]):
        return w, False
    return op.args[0], True


def config_space(rows_hi: int | None, target: Target, dtype) -> list[Config]:
    """A decode step's tiles of 16 or 32 rows (each program streams its expert's
    columns, so deep K steps too); a prompt's the matmul template's tiles for the
    target (its Hopper list: up to 128 x 256 on 8 warps, each tile's neighbours)."""
    if rows_hi is not None and rows_hi <= SPREAD_ROWS:
        out = []
        for bm in (16, 32):
            for bn in (32, 64, 128):
                for bk in (32, 64, 128):
                    out += [Config.make(4, st, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
                            for st in (2, 3)]
        return out
    tiles = matmul_configs.HOPPER if _hopper(target, dtype) else matmul_configs.CLASSIC
    return [Config.make(w, st, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
            for bm, bn, bk, w, st in tiles if bm >= 16 and bn >= 32]


def _hopper(target: Target, dtype) -> bool:
    return (target.backend in ("cuda", "interpret") and isinstance(target.arch, int)
            and target.arch >= 90 and dtype != torch.float32)


FEW_EXPERTS = 16  # Mixtral's 8: hundreds of a prompt's rows each, the largest tile


def heuristic(target: Target, rows_hi: int | None, experts: int, dtype) -> Config:
    if target.backend == "interpret":
        return Config.make(4, 1, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)
    if rows_hi is not None and rows_hi <= SPREAD_ROWS:
        return Config.make(4, 3, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)
    if not _hopper(target, dtype):
        return Config.make(4, 4, BLOCK_M=64, BLOCK_N=128, BLOCK_K=32)
    if experts <= FEW_EXPERTS:
        return Config.make(8, 3, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64)
    return Config.make(4, 4, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64)


def generate(region: Region, plan: DispatchPlan, target: Target) -> KernelSpec:
    """The grouped GEMM kernel of `region`; raises CodegenUnsupported saying why not."""
    x, w, offs, out, S, K, N, E, dtype, transposed = analyse(region, plan)
    p = SymbolicArgs(plan.symbols)
    for name in list(region.inputs) + list(region.outputs):
        p.check_extent(plan.values[name].numel)
    xp = p.tensor(x, dtype, (S, K))
    wp = p.tensor(w, dtype, (E, N, K) if transposed else (E, K, N))
    w_at = "rn[None, :] * K + kk[:, None]" if transposed else "kk[:, None] * N + rn[None, :]"
    op = p.tensor(offs, plan.values[offs].dtype, (E,))
    outp = p.tensor(out, dtype, (S, N), output=True)
    rows = p.dim(S)
    wide = ".to(tl.int64)" if p.needs_int64 else ""
    body = [
        f"S = {rows}", f"K: tl.constexpr = {K}", f"N: tl.constexpr = {N}",
        f"E: tl.constexpr = {E}", f"EP: tl.constexpr = {_pow2(E)}",
        f"pid = tl.program_id(0){wide}",
        "tiles_n = tl.cdiv(N, BLOCK_N)",
        "pid_m = pid // tiles_n", "pid_n = pid % tiles_n",
        "rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
        "rk = tl.arange(0, BLOCK_K)",
        "n_ok = rn < N",
        "eo = tl.arange(0, EP)",
        "live = eo < E",
        f"ends = tl.load({op} + eo, mask=live, other=0).to(tl.int64)",
    ]
    rows_hi = bounds_of(S, plan.symbols).hi
    spread = rows_hi is not None and rows_hi <= SPREAD_ROWS
    product = _product(xp, wp, w_at, dtype, target)
    body += (_spread(op, outp, product, dtype, wide) if spread
             else _expert_tiles(op, outp, product, dtype, wide))
    name = kernel_name("grouped_mm", region)
    tunables = ["BLOCK_M", "BLOCK_N", "BLOCK_K"]
    params = p.names() + [f"{t}: tl.constexpr" for t in tunables]
    source = module_source(name, params, body, set(), target, p.describe())
    configs = config_space(rows_hi, target, dtype)
    default = heuristic(target, rows_hi, E, dtype)
    if default not in configs:
        configs.insert(0, default)
    grid = (f"cdiv({p.grid(S)}, BLOCK_M) * cdiv({N}, BLOCK_N)" if spread else
            f"(cdiv({p.grid(S)}, BLOCK_M) + {E}) * cdiv({N}, BLOCK_N)",
            "BLOCK_M" if spread else "1")
    # the resource model of a tiled matmul with a second accumulator (the kept rows)
    meta = {"form": "tiled", "dtype": str(dtype).replace("torch.", ""), "epilogue_loads": 1,
            "timing_fill": {offs: {"even_offsets": str(S)}}}  # rows shared as routed
    return KernelSpec(name, source, p.args(), tunables, grid, configs, default, "matmul",
                      meta, 64 if p.needs_int64 else 32)


SPREAD_ROWS = 64  # up to this many rows (a decode step's pairs) each expert a program


def _product(xp: str, wp: str, w_at: str, dtype, target: Target) -> list[str]:
    """Lines computing `acc`, this tile's rows times expert `e`'s matrix."""
    exact = ', input_precision="ieee"' if dtype == torch.float32 else ""
    return [
        "acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)",
        f"w_e = {wp} + e * (K * N)",
        "for k0 in range(0, K, BLOCK_K):",
        "    kk = k0 + rk",
        f"    a = tl.load({xp} + rm[:, None] * K + kk[None, :], "
        "mask=m_ok[:, None] & (kk[None, :] < K), other=0.0)",
        f"    b = tl.load(w_e + {w_at}, mask=(kk[:, None] < K) & n_ok[None, :], other=0.0)",
        f"    acc = tl.dot({dot_operand('a', dtype, target)}, "
        f"{dot_operand('b', dtype, target)}, acc{exact})",
    ]


def _rows_of(op: str) -> list[str]:
    """Lines setting `start`, `end`: the rows expert `e` owns."""
    return [f"start = tl.load({op} + tl.maximum(e - 1, 0)).to(tl.int64)",
            "start = tl.where(e > 0, start, 0)",
            f"end = tl.load({op} + e).to(tl.int64)"]


def _expert_tiles(op: str, outp: str, product: list[str], dtype, wide: str) -> list[str]:
    """A prompt's rows: row tile pid_m is tile t of the expert whose cumulative tile
    count first exceeds it; past the experts' tiles, tiles of the rows in no expert
    (stored as zeros); past those, nothing."""
    return [
        f"starts = tl.load({op} + eo - 1, mask=live & (eo > 0), other=0).to(tl.int64)",
        "counts = tl.where(live, tl.maximum(ends - starts, 0), 0)",
        "tiles = ((counts + BLOCK_M - 1) // BLOCK_M).to(tl.int32)",
        "upto = tl.cumsum(tiles, 0)  # tiles of the experts up to and including each",
        f"e = tl.sum((upto <= pid_m).to(tl.int32), axis=0){wide}",
        "if e < E:",
        "    mine = eo == e",
        "    start = tl.sum(tl.where(mine, starts, 0), axis=0)",
        "    end = tl.minimum(tl.sum(tl.where(mine, ends, 0), axis=0), S)",
        "    t = pid_m - tl.sum(tl.where(mine, upto - tiles, 0), axis=0)",
        "    rm = start + t * BLOCK_M + tl.arange(0, BLOCK_M)",
        "    m_ok = rm < end",
        *_indent(product),
        f"    tl.store({outp} + rm[:, None] * N + rn[None, :], acc.to({_TL[dtype]}), "
        "mask=m_ok[:, None] & n_ok[None, :])",
        "else:  # the rows in no expert, after the last expert's: zeros",
        "    total = tl.minimum(tl.max(tl.where(live, ends, 0), axis=0), S)",
        "    rm = total + (pid_m - tl.sum(tiles, axis=0)) * BLOCK_M + tl.arange(0, BLOCK_M)",
        f"    tl.store({outp} + rm[:, None] * N + rn[None, :], "
        f"tl.zeros([BLOCK_M, BLOCK_N], {_TL[dtype]}), mask=(rm < S)[:, None] & n_ok[None, :])",
    ]


def _spread(op: str, outp: str, product: list[str], dtype, wide: str) -> list[str]:
    """A decode step's few rows, each pair of a token and its expert often an expert of
    its own (and the experts between them empty): program j of grid axis 1 takes the
    expert whose rows start at the tile's row j (or, for j = 0, the expert of the
    tile's first row), so each expert with rows in the tile gets one program, side by
    side, storing the rows it owns; program 0 also zeroes the rows in no expert."""
    return [
        "first = pid_m * BLOCK_M",
        "rm = first + tl.arange(0, BLOCK_M)",
        "m_ok = rm < S",
        "j = tl.program_id(1)",
        "r = first + j",
        f"total = tl.load({op} + E - 1).to(tl.int64)",
        "if j == 0:",
        f"    tl.store({outp} + rm[:, None] * N + rn[None, :], "
        f"tl.zeros([BLOCK_M, BLOCK_N], {_TL[dtype]}), "
        "mask=(m_ok & (rm >= total))[:, None] & n_ok[None, :])",
        f"e = tl.sum((live & (ends <= r)).to(tl.int32), axis=0){wide}",
        "if (r < S) & (r < total):",
        *_indent(_rows_of(op)),
        "    if (j == 0) | (start == r):  # the tile's first row, or its expert's first",
        *_indent(product, 2),
        "        owned = m_ok & (rm >= start) & (rm < end)",
        f"        tl.store({outp} + rm[:, None] * N + rn[None, :], acc.to({_TL[dtype]}), "
        "mask=owned[:, None] & n_ok[None, :])",
    ]


def _indent(lines: list[str], n: int = 1) -> list[str]:
    return ["    " * n + line for line in lines]
