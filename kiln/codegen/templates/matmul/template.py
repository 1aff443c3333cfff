"""The matmul template: a region's mm / bmm / addmm as a tiled Triton kernel.

Operands are read through their views by the emitter's index maps, so a linear
layer's weight, which arrives as permute(W) of an [N, K] parameter, is read in place
(`B[k, n]` at `W + n * K + k`, never copied), and attention's [B, H, T, D] output
viewed as o_proj's [B*T, H*D] input is read where it lies. Tiles accumulate in fp32;
fp16/bf16 inputs use the tensor cores, fp32 inputs exact ("ieee") products so results
match eager to 1e-5. addmm's bias and scalars are applied in the kernel; the product
is rounded to its dtype, as eager does, and the region's epilogue (the ops after the
product: bias, activation, residual, cast, SwiGLU's silu * mul) is computed by the
emitter at the tile before the single store.

When the M dimension's upper bound is small (decode: M = batch) the region gets a
GEMV form instead: each program owns BLOCK_N output columns for every row and
streams the weight once, since a [16, K] x [K, N] tensor-core tile would mostly
multiply padding. An unbounded M gets the tiled form with masked tails. The GEMV
form also runs an RMSNorm folded into its region (kiln.dispatch.fold_rmsnorm): the K
loop multiplies x * w (the norm's weight) by the weight tile and sums x^2 beside it,
and each row's accumulators are scaled by rsqrt(mean(x^2) + eps) once, after split
parts are combined and before bias and epilogue. A folded LayerNorm
(kiln.dispatch.layernorm_prologue) needs each row's mean before the product, so each
program first loads its rows of x whole (one vector load a row, K <= LAYER_NORM_MAX_K)
and takes their mean and variance, two-pass as eager; the K loop then multiplies
((x - mean) * rstd) * w + b. It computes the norm in fp32 where eager rounds y to x's
dtype before the product: within fp16 / bf16 tolerance.
Sibling products grouped into one region (kiln.dispatch.group_siblings) whose one
output's epilogue reads them all at its own element (SwiGLU over separate gate and up
weights) are computed by one GEMV program at the same columns, each from its own
weight (`partners`); siblings with outputs of their own are templates/matmul/grouped.py's.

Both forms may split K across programs when the output has too few tiles to fill the
GPU (kiln.codegen.templates.split_k; the count is chosen at launch, up to the config's
SPLIT_K): the last program of a tile sums the parts and alone runs the epilogue.
K is loaded unmasked when every config's BLOCK_K divides it. Configs and the default
choice: kiln.codegen.templates.matmul.configs.

Size-1 dims: an index map reads a dim of size 1 at the constant 0, so a value read
through one lacks that block dim (a [BLOCK_M, 1] operand when N = 1). tl.dot needs
whole tiles and tl.store a pointer block of the value's shape, so such operands are
broadcast to the tile (zeroed past K) and such stores widened; ordinary shapes emit
the same code as before. An epilogue may broadcast the product (`(x @ w) - x` with
N = 1): the tile then walks the output, and each lane computes the product at its
broadcast source (rows and columns wrap modulo M and N).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.codegen.build.spec import KernelSpec
from kiln.codegen.expr.emit import Emitter, kernel_name, module_source
from kiln.codegen.expr.indexing import (
    Lin,
    Opaque,
    Var,
    broadcast_index,
    delinearize,
    known_nonneg,
    modidx,
    reshape_index,
)
from kiln.codegen.expr.kernel_args import SymbolicArgs
from kiln.codegen.expr.values import CodegenUnsupported, Cond, EpilogueApart, Val, mask_of
from kiln.codegen.templates import split_k as split
from kiln.codegen.templates.matmul import configs as cfg
from kiln.codegen.templates.op_operands import operand_shape as _shape
from kiln.dispatch.fold_rmsnorm import gemv_max_rows
from kiln.dispatch.layernorm_prologue import LAYER_NORM_MAX_K, LayerNormRows, match_layer_norm
from kiln.dispatch.rmsnorm_prologue import (
    RowNorm,
    closure,
    match_row_norm,
    read_only_as_operand,
)
from kiln.ir.ops import IDENTITY_OPS, MATMULS, SHAPE_ONLY_OPS, OpCategory, bind_args, category
from kiln.ir.plan import DispatchPlan, Ref, Region
from kiln.ir.symbolic import Dim, bounds_of, numel, same_dim
from kiln.target import Target

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# gemv_max_rows (kiln.dispatch.fold_rmsnorm): rows up to which the GEMV form beats a
# padded tensor-core tile


def dot_operand(code: str, dtype: torch.dtype, target: Target) -> str:
    """A tl.dot operand; Triton's interpreter multiplies bf16's raw bits, so there it is
    widened to fp32 first (exact: the products of bf16 values fit fp32)."""
    if dtype == torch.bfloat16 and target.backend == "interpret":
        return f"{code}.to(tl.float32)"
    return code


@dataclass
class MatmulShape:
    a: str  # the product's operands: names of region values / ops
    b: str
    bias: Ref | None  # addmm's input (broadcast to [M, N])
    alpha: float
    beta: float
    batched: bool  # bmm: operands [batch, M, K] x [batch, K, N]
    batch: Dim
    m: Dim
    n: Dim
    k: Dim
    dtype: torch.dtype  # of the operands and the product
    # an RMSNorm or LayerNorm of A's rows folded in (fold_rmsnorm)
    norm: RowNorm | LayerNormRows | None = None


def analyse(region: Region, plan: DispatchPlan, anchor=None, siblings=()) -> MatmulShape:
    """The region's product (`anchor`, default its first); raises CodegenUnsupported
    (why) if the template cannot run it. `siblings`: the other products of a region of
    grouped sibling GEMVs (dispatch/group_siblings.py), which may read the same norm."""
    anchor = anchor or region.anchor()
    if anchor.target not in MATMULS:
        raise CodegenUnsupported(f"anchor {anchor.target} is not mm, bmm or addmm")
    if anchor.dtype not in _FLOATS:
        raise CodegenUnsupported(f"a product in {anchor.dtype}")
    addmm = anchor.target == "aten.addmm.default"
    a_ref, b_ref = anchor.args[1:3] if addmm else anchor.args[:2]
    if not (isinstance(a_ref, Ref) and isinstance(b_ref, Ref)):
        raise CodegenUnsupported("an operand that is not a tensor")
    batched = anchor.target == "aten.bmm.default"
    *lead, m, n = anchor.shape
    k = _shape(region, plan, a_ref.name)[-1]
    bias, alpha, beta = None, 1.0, 1.0
    if addmm:
        bias = anchor.args[0] if isinstance(anchor.args[0], Ref) else None
        if bias is None:
            raise CodegenUnsupported("addmm with a non-tensor input")
        a = bind_args(anchor)
        alpha, beta = float(a["alpha"]), float(a["beta"])
    norm = None
    if any(category(o.target) == OpCategory.REDUCTION for o in region.ops):
        norm = _row_norm(region, anchor, 1 if addmm else 0, k, siblings)
    return MatmulShape(a_ref.name, b_ref.name, bias, alpha, beta, batched,
                       lead[0] if batched else 1, m, n, k, anchor.dtype, norm)


def _row_norm(region: Region, anchor, arg: int, k: Dim, siblings=()):
    """The RMSNorm or LayerNorm of A's rows the region computes as its prologue
    (fold_rmsnorm); raises CodegenUnsupported for any other reduction in a matmul region."""
    ops = {o.name: o for o in region.ops}
    src = anchor.args[arg]
    while isinstance(src, Ref) and src.name in ops and (
            ops[src.name].target in SHAPE_ONLY_OPS | IDENTITY_OPS):
        src = ops[src.name].args[0]
    norm = (match_row_norm(ops, src.name) or match_layer_norm(ops, src.name)
            if isinstance(src, Ref) else None)
    if (norm is None or anchor.target == "aten.bmm.default" or not same_dim(norm.dim, k)
            or not read_only_as_operand(region.ops, region.outputs, anchor, arg, norm.out,
                                        closure(ops, norm.out), _left_args(siblings))):
        raise CodegenUnsupported("a reduction in a matmul region that is not an RMSNorm or "
                                 "LayerNorm of its left operand's rows read only by the "
                                 "product")
    if norm.dim == 1:
        raise CodegenUnsupported("a norm over a single element")
    if isinstance(norm, LayerNormRows) and not (isinstance(norm.dim, int)
                                                and norm.dim <= LAYER_NORM_MAX_K):
        raise CodegenUnsupported(f"a folded LayerNorm over more than {LAYER_NORM_MAX_K} "
                                 "elements (each program loads its rows whole)")
    return norm


def _left_args(mats) -> tuple:
    return tuple((m, 1 if m.target == "aten.addmm.default" else 0) for m in mats)


def products(region: Region) -> list:
    """The region's matmul ops: one, or several for grouped siblings."""
    return [o for o in region.ops if category(o.target) == OpCategory.MATMUL]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


MAX_SHIFTS = 3  # column offsets at which one program computes the product


class _Shifted(Exception):
    """The epilogue reads the product `shift` columns right of the tile's own."""

    def __init__(self, shift: int):
        super().__init__(shift)
        self.shift = shift


def generate(region: Region, plan: DispatchPlan, target: Target) -> KernelSpec:
    """The matmul (or GEMV) kernel of `region`; raises CodegenUnsupported saying why not.

    An epilogue that reads the product at a constant column offset as well as at the
    tile's own columns (SwiGLU after `chunk`: silu(p[:, :F]) * p[:, F:]) gets, in the
    GEMV form, a program that streams both column blocks of the weight, so the [M, 2F]
    product is never stored; the offsets are found by generating, and generating
    again. The tiled form raises EpilogueApart instead: on an H100 the paired tile ran
    at 555 TFLOP/s (two dots a K step) and 529 (one interleaved dot), where cuBLAS's
    product and a pointwise kernel after it take 0.69 ms a Llama-3-8B layer against
    0.87-0.91 at 2048 tokens."""
    mats = products(region)
    shape, shifts = analyse(region, plan, mats[0], mats[1:]), ()
    # paired siblings (SwiGLU over separate gate and up weights): one output whose
    # epilogue reads every product at its own element, computed in one program
    partners = [(m, analyse(region, plan, m, [x for x in mats if x is not m]))
                for m in mats[1:]]
    if partners and len(region.outputs) != 1:
        raise CodegenUnsupported("sibling products with outputs of their own: the grouped "
                                 "GEMV's (templates/matmul/grouped.py)")
    for _, sh in partners:
        if not (same_dim(sh.m, shape.m) and same_dim(sh.n, shape.n)
                and same_dim(sh.k, shape.k) and sh.dtype == shape.dtype and not sh.batched):
            raise CodegenUnsupported("paired sibling products of different sizes or dtypes")
    while True:
        try:
            return _MatmulSource(region, plan, target, shape, shifts, partners=partners).spec()
        except _Shifted as e:
            if len(shifts) == MAX_SHIFTS:
                raise CodegenUnsupported(f"the epilogue reads the product at more than "
                                         f"{MAX_SHIFTS} column offsets") from None
            shifts += (e.shift,)


class _MatmulSource:
    """One product's kernel source. `partners`: (product, its shape) of sibling products
    the epilogue reads at the tile's own element, computed at the same columns from
    their own weights. `anchor` / `output` / `shared`: a grouped GEMV's sibling
    (templates/matmul/grouped.py), writing its code with the `shared` source's
    arguments and emitter."""

    def __init__(self, region, plan, target, shape: MatmulShape, shifts: tuple = (),
                 partners=(), anchor=None, output=None, shared=None):
        self.region, self.plan, self.s, self.shifts = region, plan, shape, shifts
        self.partners = list(partners)
        if self.partners and shifts:
            raise CodegenUnsupported("paired sibling products with an epilogue that also "
                                     "reads a product at shifted columns")
        self.shifted: dict = {}  # shift -> the product at those columns (set by _finish)
        self.paired: dict = {}  # partner product name -> its value (set by _finish)
        self.p = shared.p if shared else SymbolicArgs(plan.symbols)
        self.anchor = anchor or region.anchor()
        self.output = output or region.outputs[0]
        self.rows, self.cols, self.out_index, self.at = self._layout()
        self.m_hi = bounds_of(self.rows, plan.symbols).hi
        self.gemv = self.m_hi is not None and self.m_hi <= gemv_max_rows(shape.dtype)
        if self.partners and not self.gemv:
            raise CodegenUnsupported("paired sibling products need the GEMV form")
        overrides = {self.anchor.name: self._acc_at}
        overrides.update({op.name: self._partner_at(op.name) for op, _ in self.partners})
        if shape.norm is not None:
            if not self.gemv or not same_dim(self.rows, shape.m):
                raise CodegenUnsupported(f"a folded RMSNorm needs the GEMV form: at most "
                                         f"{gemv_max_rows(shape.dtype)} rows, the "
                                         "product's own")
            if shared is None:
                overrides[shape.norm.out] = self._normed_at
        self._a_mask, self._norm_x = mask_of(), None
        if shared is None:
            self.em = Emitter(region, plan, self.p, target, overrides=overrides)
        else:
            self.em = shared.em
            self.em.overrides.update(overrides)
        kind = "gemv" if self.gemv else "matmul"
        self.centred = isinstance(shape.norm, LayerNormRows)
        self._stats_of: int | None = None  # the row whose raw x `_normed_at` returns
        self._row = 0  # the GEMV row being loaded
        suffix = "_layernorm" if self.centred else "_rmsnorm" if shape.norm else ""
        self.name = kernel_name(kind + suffix, region)

    def _layout(self):
        """The tile's extents (rows, cols), the output element each lane stores, and the
        product element it computes. Usually the output is the product or a reshape of it
        and the tile walks the product. When the epilogue broadcasts the product, the tile
        walks the output (rows over its leading dims, a bmm's batch kept) and a lane
        computes the product at its own row and column modulo M and N: the broadcast
        source. `_acc_at` checks that the epilogue reads exactly that element."""
        s = self.s
        product = tuple(self.anchor.shape)
        out = tuple(self.plan.values[self.output].shape)
        if same_dim(numel(out), numel(product)):
            tile = self._batch() + (Lin.of(Var("rm2", s.m)), Lin.of(Var("rn2", s.n)))
            return s.m, s.n, reshape_index(tile, product, out), tile
        if not out or (s.batched and (len(out) != 3 or not same_dim(out[0], s.batch))):
            raise CodegenUnsupported(f"an epilogue output {list(out)} that is neither a "
                                     f"reshape nor a broadcast of the product {list(product)}")
        lead = out[1:-1] if s.batched else out[:-1]
        rows, cols = Var("rm2", numel(lead)), Var("rn2", out[-1])
        index = self._batch() + delinearize(Lin.of(rows), lead) + (Lin.of(cols),)
        at = self._batch() + (modidx(rows, 1, s.m), modidx(cols, 1, s.n))
        return rows.size, cols.size, index, at

    def _acc_at(self, index):
        # A size-1 dim is read at index 0 by broadcasting ops: the same element as the tile's.
        if all(d == 1 or a.equals(b) for a, b, d in zip(index, self.at, self.anchor.shape)):
            return self.product
        shift = self._column_shift(index)
        if shift is None:
            return None  # the epilogue reads the product elsewhere: not this template's
        if not self.gemv:
            raise EpilogueApart(f"the epilogue reads the product {shift} columns right of "
                                "the tile's own: a tiled product runs apart from it")
        if shift not in self.shifts:
            raise _Shifted(shift)
        return self.shifted[shift]

    def _partner_at(self, name: str):
        """The partner product `name` at `index`: only at the tile's own element."""
        def at(index):
            if all(d == 1 or a.equals(b) for a, b, d in zip(index, self.at, self.anchor.shape)):
                return self.paired[name]
            return None
        return at

    def _normed_at(self, index):
        """The folded norm's value at `index` without its row scale: x times its factors
        (the weight), in fp32. The scale multiplies the product (`_row_scale`); casts
        between are skipped, so the norm is computed in fp32 throughout, where eager
        rounds y to x's dtype first: within fp16 / bf16 tolerance. Records x for the
        sum of squares."""
        em, norm, mask = self.em, self.s.norm, self._a_mask
        shape = em.shape(norm.out)
        x = em.value(norm.x, broadcast_index(index, shape, em.shape(norm.x)), mask)
        v = self._norm_x = em.cast(x, torch.float32)
        if self.centred:
            return v if self._stats_of is not None else self._centred(v, index, shape)
        for op, other in norm.factors(em.ops):
            f = em.cast(em.operand(op, other, index, mask), torch.float32)
            v = em.let(f"{v.code} * {f.code}", torch.float32, v.vars | f.vars)
        return v

    def _centred(self, x: Val, index, shape) -> Val:
        """A folded LayerNorm's value: ((x - mean) * rstd) * w + b, in fp32, with the
        row's statistics from `_row_stats` (the row being loaded: `self._row`)."""
        em, norm, mi = self.em, self.s.norm, self._row
        v = em.let(f"({x.code} - mean{mi}) * rstd{mi}", torch.float32, x.vars)
        for param, sign in ((norm.weight, "*"), (norm.bias, "+")):
            if param is not None:
                p = em.value(param, broadcast_index(index, shape, em.shape(param)),
                             self._a_mask)
                p = em.cast(p, torch.float32)
                v = em.let(f"{v.code} {sign} {p.code}", torch.float32, v.vars | p.vars)
        return v

    def _row_stats(self, mi: int, row) -> list[str]:
        """Row `mi`'s mean and rstd for a folded LayerNorm: its x loaded whole (`kf` over
        the padded K), summed, then its centred squares summed (eager's two passes)."""
        s, p = self.s, self.p
        kp, k = cfg.pow2(s.norm.dim), p.dim(s.norm.dim)
        ok = Cond("kf_ok", frozenset({"kf"}))
        self._stats_of, self._a_mask = mi, mask_of(ok)
        try:
            lines, x = self._load(s.a, self._batch() + (row, Lin.of(Var("kf", s.k))),
                                  mask_of(ok), ("kf",), f"[{kp}]", "kf", ok.code)
        finally:
            self._stats_of = None
        return [*lines,
                f"xf{mi} = tl.where(kf_ok, {x}.to(tl.float32), 0.0)",
                f"mean{mi} = tl.sum(xf{mi}, 0) / {k}",
                f"xc{mi} = tl.where(kf_ok, xf{mi} - mean{mi}, 0.0)",
                f"rstd{mi} = tl.rsqrt(tl.sum(xc{mi} * xc{mi}, 0) / {k} + {s.norm.eps!r})"]

    def _sum_squares(self, mi: int, k_ok: Cond | None) -> list[str]:
        """Row `mi`'s x^2 over this K block, added lane by lane to `ss{mi}` (x as
        `_normed_at` computed it for the block); summed across lanes once, after the
        loop (`_squares_total`)."""
        x = self._norm_x
        if x is None or "kk" not in x.vars:
            raise CodegenUnsupported("the folded RMSNorm's x does not vary along K")
        sq = f"{x.code} * {x.code}"
        if k_ok is not None:
            sq = f"tl.where({k_ok.code}, {sq}, 0.0)"
        return [f"ss{mi} += {sq}"]

    def _squares_total(self, mp: int) -> list[str]:
        """`ss`: each row's sum of x^2 over this program's K range."""
        return [f"ss = tl.zeros([{mp}], dtype=tl.float32)"] + [
            f"ss += tl.where(rm == {mi}, tl.sum(ss{mi}, 0), 0.0)" for mi in range(mp)]

    def _row_scale(self) -> list[str]:
        """Each row's accumulators times rsqrt(mean(x^2) + eps): after split parts are
        combined (each part is a partial dot product and a partial sum of squares, so
        the scale applies once, to the whole sums), before bias and epilogue."""
        norm = self.s.norm
        lines = [f"row_scale = tl.rsqrt(ss / {self.p.dim(norm.dim)} + {norm.eps!r})"]
        return lines + [f"{acc} = {acc} * row_scale[:, None]" for acc, *_ in self._accs()]

    def _column_shift(self, index) -> int | None:
        """C when `index` is the tile's own element C > 0 columns right, within the
        product for every column the tile stores (cols + C <= N); else None."""
        lead = zip(index[:-1], self.at[:-1], self.anchor.shape[:-1])
        if not all(d == 1 or a.equals(b) for a, b, d in lead):
            return None
        own = Lin.of(self.at[-1])
        if own.var_names() != {"rn2"}:
            return None
        diff = Lin.of(index[-1]) - own
        if diff.terms or not isinstance(diff.const, int) or diff.const <= 0:
            return None
        room = self.s.n - self.cols - diff.const
        return diff.const if known_nonneg(room) else None

    def _accs(self) -> list[tuple[str, str, int, MatmulShape]]:
        """(accumulator, B's column variable, column shift, the product's shape) of each
        product block: the anchor's, its shifted columns', its partners'."""
        s = self.s
        return ([("acc", "rb2", 0, s)]
                + [(f"acc_{i}", f"rb2_{i}", c, s) for i, c in enumerate(self.shifts, 1)]
                + [(f"acc_p{i}", "rb2", 0, sh) for i, (_, sh) in enumerate(self.partners, 1)])

    def _batch(self) -> tuple:
        return (Lin.of(Var("pid_b", self.s.batch, block=False)),) if self.s.batched else ()

    def spec(self) -> KernelSpec:
        s, p, target = self.s, self.p, self.em.target
        for v in list(self.region.inputs) + list(self.region.outputs):
            p.check_extent(self.plan.values[v].numel)
        p.check_extent(s.batch * self.rows * self.cols)
        k, batch = p.grid(s.k), p.grid(s.batch)
        if self.gemv:
            tunables = ["BLOCK_N", "BLOCK_K", "SPLIT_K"]
            cols, tiles = self._gemv_tiles()
            configs = cfg.gemv_configs(cols, s.k)
            fill, least = cfg.GEMV_FILL, cfg.MIN_GEMV_BLOCKS
            part = f"{cfg.pow2(self.m_hi)} * BLOCK_N"
            if len(self._accs()) > 1:  # an accumulator per product block
                part = f"{len(self._accs())} * {part}"
            if s.norm is not None and not self.centred:  # parts carry sums of squares
                part += f" + {cfg.pow2(self.m_hi)}"
        else:
            tunables = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K"]
            configs = cfg.tiled_configs(self.rows, self.m_hi, self.cols, s.k, s.batch,
                                        _name(s.dtype), target)
            tiles = f"cdiv({p.grid(self.rows)}, BLOCK_M) * cdiv({p.grid(self.cols)}, BLOCK_N)"
            fill, least = cfg.TILED_FILL, cfg.MIN_SPLIT_BLOCKS
            part = "BLOCK_M * BLOCK_N"
        if self.shifts or self.partners:
            configs = cfg.paired(configs, 1 + len(self.shifts) + len(self.partners))
        # K needs no mask when every config's BLOCK_K divides it (splits are whole blocks)
        self.even_k = isinstance(s.k, int) and all(s.k % c["BLOCK_K"] == 0 for c in configs)
        all_tiles = f"{tiles} * {batch}"
        n_split = split.count("SPLIT_K", all_tiles, fill * target.multiprocessors,
                              f"cdiv({k}, {least} * BLOCK_K)")
        body = self._gemv_body() if self.gemv else self._tiled_body()
        params = p.names() + [split.PARTS, split.COUNTS] + [f"{t}: tl.constexpr"
                                                              for t in tunables]
        source = module_source(self.name, params, body, self.em.helpers, target,
                               p.describe())
        out = self.output
        meta = {"form": "gemv" if self.gemv else "tiled", "dtype": _name(s.dtype),
                "out_dtype": _name(self.plan.values[out].dtype),
                "m_pad": cfg.pow2(self.m_hi) if self.gemv else None,
                "epilogue_loads": self._epilogue_loads, "column_shifts": list(self.shifts),
                "row_norm": s.norm is not None, "layer_norm": self.centred,
                "siblings": [self.anchor.name] + [op.name for op, _ in self.partners]}
        return KernelSpec(self.name, source, p.args(), tunables, (tiles, batch, n_split),
                          configs, configs[0], "matmul", meta, 64 if p.needs_int64 else 32,
                          scratch=split.scratch(all_tiles, n_split, part))

    def _dot(self, x: str, w: str) -> str:
        x, w = dot_operand(x, self.s.dtype, self.em.target), dot_operand(w, self.s.dtype,
                                                                           self.em.target)
        ieee = ', input_precision="ieee"' if self.s.dtype == torch.float32 else ""
        return f"tl.dot({x}, {w}, acc{ieee}, out_dtype=tl.float32)"

    def _load(self, name: str, index, mask, span: tuple, shape: str,
              k_var: str, k_ok: str | None) -> tuple[list[str], str]:
        """Lines loading operand `name` at `index` (through its views), and the value as
        a whole `shape` block over the variables `span`. A value lacking some of them (a
        size-1 dim read at 0, a broadcast) is broadcast; lacking K's, it was read
        unmasked, so the lanes past K (`k_ok` false) are zeroed first."""
        with self.em.block() as lines:
            v = self.em.value(name, index, mask)
            if set(span) <= v.vars:
                return lines, v.code
            code = self.em.tensor(v).code
            if k_ok is not None and k_var not in v.vars:
                code = f"tl.where({k_ok}, {code}, 0)"
            v = self.em.let(f"tl.broadcast_to({code}, {shape})", v.dtype, frozenset(span))
        return lines, v.code

    def _wide(self) -> str:
        return ".to(tl.int64)" if self.p.needs_int64 else ""

    def _k_range(self, k: str) -> list[str]:
        """This program's K range [lo, hi): all of K, or its split's whole blocks."""
        return ["lo = 0", f"hi = {k}", "if SPLIT_K > 1:",
                *["    " + x for x in split.program_range(k, "BLOCK_K")]]

    def _k_mask(self, name: str, var: str) -> Cond | None:
        return None if self.even_k else Cond(name, frozenset({var}))

    def _tiled_body(self) -> list[str]:
        s, p = self.s, self.p
        m, n, k, wide = p.dim(s.m), p.dim(s.n), p.dim(s.k), self._wide()
        rows, cols = p.dim(self.rows), p.dim(self.cols)
        head = [
            f"pid_b = tl.program_id(1){wide}",
            "pid = tl.program_id(0)",
            "pid_s = tl.program_id(2)",
            "n_split = tl.num_programs(2)",
            f"grid_m = tl.cdiv({rows}, BLOCK_M)",
            f"grid_n = tl.cdiv({cols}, BLOCK_N)",
            "width = GROUP_M * grid_n",  # GROUP_M row tiles share B tiles in L2
            "first_m = (pid // width) * GROUP_M",
            "group_rows = tl.minimum(grid_m - first_m, GROUP_M)",
            "pid_m = first_m + (pid % width) % group_rows",
            "pid_n = (pid % width) // group_rows",
            f"rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M){wide}",
            f"rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N){wide}",
            # Wrapped rows / columns read valid memory; only the store is masked.
            f"ra2 = (rm % {m})[:, None]",
            f"rb2 = (rn % {n})[None, :]",
            "rk = tl.arange(0, BLOCK_K)",
            "acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)",
            *self._k_range(k),
            "for k0 in range(lo, hi, BLOCK_K):",
        ]
        kk_a, kk_b = Var("ka2", s.k), Var("kb2", s.k)
        a_idx = self._batch() + (Lin.of(Var("ra2", s.m)), Lin.of(kk_a))
        ka_ok, kb_ok = self._k_mask("ka_ok", "ka2"), self._k_mask("kb_ok", "kb2")
        a_lines, a = self._load(s.a, a_idx, mask_of(ka_ok), ("ra2", "ka2"),
                                "[BLOCK_M, BLOCK_K]", "ka2", ka_ok and ka_ok.code)
        loop = ["kk = k0 + rk", "ka2 = kk[None, :]", "kb2 = kk[:, None]"]
        if not self.even_k:
            loop += [f"ka_ok = ka2 < {k}", f"kb_ok = kb2 < {k}"]
        b_idx = self._batch() + (Lin.of(kk_b), Lin.of(Var("rb2", s.n)))
        b_lines, b = self._load(s.b, b_idx, mask_of(kb_ok), ("kb2", "rb2"),
                                "[BLOCK_K, BLOCK_N]", "kb2", kb_ok and kb_ok.code)
        loop += [*a_lines, *b_lines, f"acc = {self._dot(a, b)}"]
        tail = ["rm2 = rm[:, None]", "rn2 = rn[None, :]", f"m_ok = rm2 < {rows}",
                f"n_ok = rn2 < {cols}"]
        offs = "tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]"
        tail += self._combine("pid_b * (grid_m * grid_n) + pid", "[BLOCK_M, BLOCK_N]",
                              "BLOCK_M * BLOCK_N", offs, cols)
        return head + ["    " + x for x in loop] + tail + self._finish()

    def _combine(self, tile: str, shape: str, numel: str, offs: str, n: str,
                 rows: int | None = None) -> list[str]:
        """With K split: store this part; the last program sums all parts and stores.
        A part holds each product block's accumulator (the anchor's, its shifted
        columns', its partners': `numel` elements each) one after another; `rows`: the
        GEMV's padded rows when a folded norm's sums of squares `ss` ride along, after
        them."""
        accs = [acc for acc, *_ in self._accs()]
        blocks = f"{len(accs)} * {numel}" if len(accs) > 1 else numel
        whole = blocks if rows is None else f"({blocks} + {rows})"
        store = [f"part_offs = {offs}"]
        combine, body = [], []
        for i, acc in enumerate(accs):
            at = f"part_offs + {i} * {numel}" if i else "part_offs"
            store.append(f"tl.store({split.part(whole)} + {at}, {acc}, mask=m_ok & n_ok)")
            combine.append(f"{acc} = tl.zeros({shape}, dtype=tl.float32)")
            load = split.load_part(f"{split.part(whole, 's')} + {at}",
                                   "m_ok & n_ok & (s < n_split)")
            body.append(f"{acc} += {load}")
        if rows is not None:
            at = f"{blocks} + tl.arange(0, {rows})"
            store.append(f"tl.store({split.part(whole)} + {at}, ss)")
            combine.append(f"ss = tl.zeros([{rows}], dtype=tl.float32)")
            body.append("ss += " + split.load_part(f"{split.part(whole, 's')} + {at}",
                                                   f"(rm < {rows}) & (s < n_split)"))
        combine += split.merge_loop(whole, body)
        gate = [f"n_ok = rn2 < tl.where(last, {n}, 0)"]  # only the last program stores
        return split.arrive("SPLIT_K", tile, store, combine, gate)

    def _gemv_tiles(self) -> tuple:
        """The columns the GEMV's configs are chosen for, and its column blocks (a grid
        expression over BLOCK_N)."""
        return self.cols, f"cdiv({self.p.grid(self.cols)}, BLOCK_N)"

    def _columns(self) -> tuple[list[str], str, str]:
        """Lines setting `pid_n`, the program's column block, from `pid`; the code of N
        and of the columns the tile stores (a grouped GEMV's are its sibling's)."""
        return ["pid_n = pid"], self.p.dim(self.s.n), self.p.dim(self.cols)

    def _weight_loads(self, kb_ok: Cond | None) -> list[str]:
        """The K step's weight tiles, `w{i}` for each product block, in fp32."""
        loop = []
        for i, (_, rb, _, sh) in enumerate(self._accs()):
            b_idx = self._batch() + (Lin.of(Var("kb2", sh.k)), Lin.of(Var(rb, sh.n)))
            b_lines, w = self._load(sh.b, b_idx, mask_of(kb_ok), ("kb2", rb),
                                    "[BLOCK_K, BLOCK_N]", "kb2", kb_ok and kb_ok.code)
            loop += [*b_lines, f"w{i} = {w}.to(tl.float32)"]
        return loop

    def _gemv_body(self) -> list[str]:
        s, p = self.s, self.p
        m, k, wide = p.dim(s.m), p.dim(s.k), self._wide()
        select, n, cols = self._columns()
        rows = p.dim(self.rows)
        mp = cfg.pow2(self.m_hi)
        head = [
            f"pid_b = tl.program_id(1){wide}",
            "pid = tl.program_id(0)",
            *select,
            "pid_s = tl.program_id(2)",
            "n_split = tl.num_programs(2)",
            f"rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N){wide}",
            f"rm = tl.arange(0, {mp})",
            *dict.fromkeys(f"{rb} = ((rn + {c}) % {n})[None, :]" if c
                           else f"{rb} = (rn % {n})[None, :]" for _, rb, c, _ in self._accs()),
            *[f"{acc} = tl.zeros([{mp}, BLOCK_N], dtype=tl.float32)"
              for acc, *_ in self._accs()],
        ]
        squares = s.norm is not None and not self.centred  # an RMSNorm's sums of x^2
        if squares:
            head += [f"ss{mi} = tl.zeros([BLOCK_K], dtype=tl.float32)" for mi in range(mp)]
        # Rows past M read row M - 1 (valid memory, one mask-free vector load per row);
        # only the store is masked.
        static_rows = isinstance(s.m, int) and s.m >= mp
        wrap = not same_dim(self.rows, s.m)  # a broadcast product: row mi reads mi mod M
        for mi in range(mp):
            if wrap:
                head.append(f"row{mi} = {mi} % {m}")
            elif not static_rows:
                head.append(f"row{mi} = tl.minimum({mi}, {m} - 1)")
        rows_at = [Lin.of(mi) if static_rows else Lin.of(Opaque(f"row{mi}", s.m))
                   for mi in range(mp)]
        if self.centred:
            head += [f"kf = tl.arange(0, {cfg.pow2(s.norm.dim)}){wide}",
                     f"kf_ok = kf < {p.dim(s.norm.dim)}"]
            for mi in range(mp):
                head += self._row_stats(mi, rows_at[mi])
        head += [*self._k_range(k), "for k0 in range(lo, hi, BLOCK_K):"]
        kk_a = Var("kk", s.k)
        kb_ok = self._k_mask("kb_ok", "kb2")
        loop = [f"kk = k0 + tl.arange(0, BLOCK_K){wide}", "kb2 = kk[:, None]"]
        if not self.even_k:
            loop += [f"k_ok = kk < {k}", f"kb_ok = kb2 < {k}"]
        loop += self._weight_loads(kb_ok)
        for mi in range(mp):  # rows unrolled: the weight tile is loaded once for all
            row = rows_at[mi]
            k_ok = self._k_mask("k_ok", "kk")
            self._a_mask, self._row = mask_of(k_ok), mi
            a_lines, x = self._load(s.a, self._batch() + (row, Lin.of(kk_a)), mask_of(k_ok),
                                    ("kk",), "[BLOCK_K]", "kk", k_ok and k_ok.code)
            work = list(a_lines)
            if squares:
                work += self._sum_squares(mi, k_ok)
            for i, (acc, *_) in enumerate(self._accs()):
                work += [f"part = tl.sum({x}.to(tl.float32)[:, None] * w{i}, 0)",
                         f"{acc} += tl.where(rm[:, None] == {mi}, part[None, :], 0.0)"]
            # Rows past a dynamic M (a decode bucket of 1 row in a module for up to 4)
            # are skipped: the weight streams once either way, but each row's load,
            # products and cross-lane sum would cost as much as a real row's.
            skip = mi > 0 and not static_rows and not wrap
            loop += [f"if {mi} < {m}:", *["    " + x for x in work]] if skip else work
        tail = ["rm2 = rm[:, None]", "rn2 = rn[None, :]", f"m_ok = rm2 < {rows}",
                f"n_ok = rn2 < {cols}"]
        if squares:
            tail += self._squares_total(mp)
        offs = f"tl.arange(0, {mp})[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]"
        tail += self._combine("pid_b * tl.num_programs(0) + pid", f"[{mp}, BLOCK_N]",
                              f"{mp} * BLOCK_N", offs, cols, mp if squares else None)
        if squares:
            tail += self._row_scale()
        return head + ["    " + x for x in loop] + tail + self._finish()

    def _finish(self) -> list[str]:
        """addmm's alpha, beta and bias; rounding to the product's dtype; the epilogue."""
        em = self.em
        mask = mask_of(Cond("m_ok", frozenset({"rm2"})), Cond("n_ok", frozenset({"rn2"})))
        em.lines = []
        products = {}
        for acc, _, c, sh in self._accs():
            if sh.alpha != 1.0:
                em.lines.append(f"{acc} = {acc} * {sh.alpha!r}")
            if sh.bias is not None:
                bshape = _shape(self.region, self.plan, sh.bias.name)
                at = self.at[:-1] + (Lin.of(self.at[-1]) + c,)
                bias = em.value(sh.bias.name, broadcast_index(at, self.anchor.shape, bshape),
                                mask)
                scale = f" * {sh.beta!r}" if sh.beta != 1.0 else ""
                em.lines.append(f"{acc} = {acc} + {bias}.to(tl.float32){scale}")
            # the product in its own dtype, rounded as eager rounds it (the emitter's cast)
            products[acc] = em.cast(Val(acc, torch.float32, frozenset({"rm2", "rn2"})),
                                    sh.dtype)
        accs = self._accs()
        self.product = products["acc"]
        self.shifted = {c: products[acc] for acc, _, c, _ in accs if c}
        self.paired = {op.name: products[f"acc_p{i}"]
                       for i, (op, _) in enumerate(self.partners, 1)}
        out, idx = self.output, self.out_index
        # a size-1 dim's index is constant: the pointer block still spans the whole tile
        em.store(out, idx, em.value(out, idx, mask), mask, span=("rm2", "rn2"))
        self._epilogue_loads = sum("tl.load(" in x for x in em.lines)
        return list(em.lines)
