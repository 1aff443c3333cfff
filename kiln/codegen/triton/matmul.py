"""The matmul template: a region's mm / bmm / addmm as a tiled Triton kernel.

Operands are read through their views as strided maps, so a linear layer's weight,
which arrives as permute(W) of an [N, K] parameter, is read in place with B's
strides swapped (never copied). Tiles accumulate in fp32; fp16/bf16 inputs use the
tensor cores, fp32 inputs use exact ("ieee") products so results match eager to
1e-5. addmm's bias and scalars are applied in the kernel, then the region's
epilogue (the ops after the product) before the single store.

When the M dimension's upper bound is small (decode: M = batch) the region gets a
GEMV form instead: each program owns BLOCK_N output columns for every row and
streams the weight once, since a [16, K] x [K, N] tensor-core tile would mostly
multiply padding. An unbounded M gets the tiled form with masked tails.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.codegen.select_kernels import register
from kiln.codegen.triton import epilogue, strided
from kiln.codegen.triton.params import Params, extent, offset_code
from kiln.codegen.triton.spec import Config, KernelSpec
from kiln.ir.plan import DispatchPlan, Region, RegionKind
from kiln.ir.symbolic import Dim, bounds_of
from kiln.target import Target

MATMULS = {"aten.mm.default", "aten.bmm.default", "aten.addmm.default"}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
GEMV_MAX_M = 8  # rows up to which the GEMV form beats a padded tensor-core tile

# Curated tiled configs (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), largest first.
_TILED = [
    (128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 32, 4, 4), (128, 64, 32, 4, 4),
    (64, 128, 32, 4, 4), (64, 128, 64, 4, 3), (64, 64, 64, 4, 3), (128, 32, 32, 4, 4),
    (64, 32, 32, 2, 5), (32, 64, 32, 2, 5), (32, 128, 64, 4, 3), (32, 32, 64, 2, 3),
    (16, 64, 128, 4, 3), (16, 128, 64, 4, 3), (16, 32, 64, 2, 2), (16, 16, 32, 1, 1),
]
_GEMV = [  # (BLOCK_N, BLOCK_K, warps, stages)
    (64, 128, 4, 3), (32, 256, 4, 3), (128, 64, 4, 3), (64, 64, 2, 3), (32, 128, 2, 2),
    (128, 128, 8, 3), (16, 64, 1, 1),
]


@dataclass
class MatmulShape:
    a: strided.Strided  # [batch, M, K]
    b: strided.Strided  # [batch, K, N]
    bias: strided.Strided | None  # addmm's input, broadcast to [1, M, N]
    alpha: float
    beta: float
    batch: Dim
    m: Dim
    n: Dim
    k: Dim
    dtype: torch.dtype  # of the operands
    out: epilogue.Epilogue  # how the product becomes the region's output


def _batched(op: strided.Strided) -> strided.Strided:
    return op if op.rank == 3 else op.with_rank(3)


def analyse(region: Region, plan: DispatchPlan) -> MatmulShape | None:
    anchor = region.anchor()
    if anchor.target not in MATMULS or anchor.dtype not in _FLOATS:
        return None
    addmm = anchor.target == "aten.addmm.default"
    a_ref, b_ref = anchor.args[1:3] if addmm else anchor.args[:2]
    a = strided.resolve(region, a_ref, plan.values)
    b = strided.resolve(region, b_ref, plan.values)
    if a is None or b is None:
        return None
    if any(plan.values[x.value].dtype != anchor.dtype for x in (a, b)):
        return None
    a, b = _batched(a), _batched(b)
    batch, m, k = a.shape
    n = b.shape[2]
    bias, alpha, beta = None, 1.0, 1.0
    if addmm:
        bias = strided.resolve(region, anchor.args[0], plan.values)
        if bias is None or bias.rank > 2:
            return None
        bias = _broadcast_2d(bias.with_rank(2), m, n)
        if bias is None:
            return None
        alpha = float(anchor.kwargs.get("alpha", 1))
        beta = float(anchor.kwargs.get("beta", 1))
    out = epilogue.analyse(region, anchor, plan)
    if out is None:
        return None
    return MatmulShape(a, b, bias, alpha, beta, batch, m, n, k, anchor.dtype, out)


def _broadcast_2d(op: strided.Strided, m, n) -> strided.Strided | None:
    st = []
    for size, stride, want in zip(op.shape, op.strides, (m, n)):
        if strided._eq(size, want):
            st.append(stride)
        elif strided._eq(size, 1):
            st.append(0)
        else:
            return None
    return strided.Strided(op.value, (1, m, n), (0, *st), op.offset)


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def tiled_configs(shape: MatmulShape, m_hi: int | None) -> list[Config]:
    out = []
    for bm, bn, bk, warps, stages in _TILED:
        if m_hi is not None and bm > max(16, _pow2(m_hi)):
            continue
        if isinstance(shape.n, int) and bn > max(16, _pow2(shape.n)):
            continue
        if isinstance(shape.k, int) and bk > max(16, _pow2(shape.k)):
            continue
        out.append(Config.make(warps, stages, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8))
    return out or [Config.make(4, 2, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=8)]


def gemv_configs(shape: MatmulShape) -> list[Config]:
    out = []
    for bn, bk, warps, stages in _GEMV:
        if isinstance(shape.n, int) and bn > max(16, _pow2(shape.n)):
            continue
        if isinstance(shape.k, int) and bk > max(16, _pow2(shape.k)):
            continue
        out.append(Config.make(warps, stages, BLOCK_N=bn, BLOCK_K=bk))
    return out or [Config.make(1, 1, BLOCK_N=16, BLOCK_K=16)]


@register(RegionKind.MATMUL)
def generate(region: Region, plan: DispatchPlan, target: Target) -> KernelSpec | None:
    shape = analyse(region, plan)
    if shape is None:
        return None
    m_hi = bounds_of(shape.m, plan.symbols).hi
    gemv = m_hi is not None and m_hi <= GEMV_MAX_M
    return _MatmulSource(region, plan, shape, m_hi, gemv).spec()


class _MatmulSource:
    def __init__(self, region, plan, shape: MatmulShape, m_hi, gemv: bool):
        self.region, self.plan, self.s = region, plan, shape
        self.m_hi, self.gemv = m_hi, gemv
        self.p = Params(plan.symbols)
        self.name = f"{'gemv' if gemv else 'matmul'}_{region.name}"

    def spec(self) -> KernelSpec:
        s, p, vals = self.s, self.p, self.plan.values
        a = p.tensor("a_ptr", s.a.value, vals[s.a.value].dtype)
        b = p.tensor("b_ptr", s.b.value, vals[s.b.value].dtype)
        bias = p.tensor("bias_ptr", s.bias.value, vals[s.bias.value].dtype) if s.bias else None
        s.out.bind(p)
        for op in (s.a, s.b) + ((s.bias,) if s.bias else ()):
            p.check_extent(extent(op))
        p.check_extent(s.batch * s.m * s.n)
        m, n, k = p.size(s.m), p.size(s.n), p.size(s.k)
        if self.gemv:
            tunables = ["BLOCK_N", "BLOCK_K"]
            grid = (f"cdiv({p.grid(s.n)}, BLOCK_N)", p.grid(s.batch))
            body = self._gemv_body(a, b, bias, m, n, k)
            configs = gemv_configs(s)
        else:
            tunables = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"]
            grid = (f"cdiv({p.grid(s.m)}, BLOCK_M) * cdiv({p.grid(s.n)}, BLOCK_N)",
                    p.grid(s.batch))
            body = self._tiled_body(a, b, bias, m, n, k)
            configs = tiled_configs(s, self.m_hi)
        params = ", ".join([x.name for x in p.args()] + [f"{t}: tl.constexpr" for t in tunables])
        source = ("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                  f"def {self.name}({params}):\n" + body)
        meta = {"form": "gemv" if self.gemv else "tiled",
                "dtype": str(s.dtype).replace("torch.", ""),
                "out_dtype": str(s.out.dtype).replace("torch.", ""),
                "m_pad": _pow2(self.m_hi) if self.gemv else None,
                "epilogue_loads": s.out.loads + (1 if s.bias else 0)}
        return KernelSpec(self.name, source, p.args(), tunables, grid, configs, configs[0],
                          "matmul", meta, 64 if p.needs_int64 else 32)

    def _common(self, L):
        wide = ".to(tl.int64)" if self.p.needs_int64 else ""
        L.append(f"pid_b = tl.program_id(1){wide}")
        return wide

    def _dot_args(self) -> str:
        return ', input_precision="ieee"' if self.s.dtype == torch.float32 else ""

    def _tiled_body(self, a, b, bias, m, n, k) -> str:
        s, p = self.s, self.p
        L: list[str] = []
        wide = self._common(L)
        L += [
            "pid = tl.program_id(0)",
            f"grid_m = tl.cdiv({m}, BLOCK_M)",
            f"grid_n = tl.cdiv({n}, BLOCK_N)",
            "width = GROUP_M * grid_n",  # GROUP_M row-tiles share B tiles in L2
            "first_m = (pid // width) * GROUP_M",
            "group_rows = tl.minimum(grid_m - first_m, GROUP_M)",
            "pid_m = first_m + (pid % width) % group_rows",
            "pid_n = (pid % width) // group_rows",
            f"rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M){wide}",
            f"rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N){wide}",
            # Wrapped rows/cols load valid memory; the store masks them out.
            f"ra = rm % {m}",
            f"rb = rn % {n}",
            "rk = tl.arange(0, BLOCK_K)",
        ]
        a_off = offset_code(p, s.a, ["pid_b", "ra[:, None]", "rk[None, :]"])
        b_off = offset_code(p, s.b, ["pid_b", "rk[:, None]", "rb[None, :]"])
        a_step = p.size(s.a.strides[2])
        b_step = p.size(s.b.strides[1])
        L += [
            f"a_ptrs = {a} + {a_off}",
            f"b_ptrs = {b} + {b_off}",
            "acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)",
            f"for k0 in range(0, {k}, BLOCK_K):",
            f"    x = tl.load(a_ptrs, mask=rk[None, :] < {k} - k0, other=0.0)",
            f"    w = tl.load(b_ptrs, mask=rk[:, None] < {k} - k0, other=0.0)",
            f"    acc = tl.dot(x, w, acc{self._dot_args()}, out_dtype=tl.float32)",
            f"    a_ptrs += BLOCK_K * {a_step}",
            f"    b_ptrs += BLOCK_K * {b_step}",
            f"ok = (rm[:, None] < {m}) & (rn[None, :] < {n})",
        ]
        L += self._finish(bias, "rm[:, None]", "rn[None, :]", "ok")
        return "".join(f"    {x}\n" for x in L)

    def _gemv_body(self, a, b, bias, m, n, k) -> str:
        s, p = self.s, self.p
        mp = _pow2(self.m_hi)
        L: list[str] = []
        wide = self._common(L)
        a_row = offset_code(p, s.a, ["pid_b", "mi", "rk"])
        b_off = offset_code(p, s.b, ["pid_b", "rk[:, None]", "rn[None, :]"])
        L += [
            f"rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N){wide}",
            f"rm = tl.arange(0, {mp})",
            "n_ok = rn < " + n,
            f"acc = tl.zeros([{mp}, BLOCK_N], dtype=tl.float32)",
            f"for k0 in range(0, {k}, BLOCK_K):",
            f"    rk = k0 + tl.arange(0, BLOCK_K){wide}",
            f"    k_ok = rk < {k}",
            f"    w = tl.load({b} + {b_off}, mask=k_ok[:, None] & n_ok[None, :], other=0.0)",
            "    w = w.to(tl.float32)",
            f"    for mi in tl.static_range({mp}):",
            # (a tensor comparison: the interpreter rejects scalar-bool masks)
            f"        x_ok = k_ok & (tl.zeros_like(rk) + mi < {m})",
            f"        x = tl.load({a} + {a_row}, mask=x_ok, other=0.0)",
            "        part = tl.sum(x.to(tl.float32)[:, None] * w, 0)",
            "        acc += tl.where(rm[:, None] == mi, part[None, :], 0.0)",
            f"ok = (rm[:, None] < {m}) & n_ok[None, :]",
        ]
        L += self._finish(bias, "rm[:, None]", "rn[None, :]", "ok")
        return "".join(f"    {x}\n" for x in L)

    def _finish(self, bias, rows: str, cols: str, ok: str) -> list[str]:
        """alpha/beta/bias of addmm, then the epilogue and the store of the region output."""
        s, p = self.s, self.p
        L = []
        if s.alpha != 1.0:
            L.append(f"acc = acc * {s.alpha!r}")
        if bias is not None:
            off = offset_code(p, s.bias, ["pid_b", rows, cols])
            term = f"tl.load({bias} + {off}, mask={ok}, other=0.0).to(tl.float32)"
            L.append(f"acc = acc + {term}" + (f" * {s.beta!r}" if s.beta != 1.0 else ""))
        # The anchor's value in its own dtype (mm rounds to it before any epilogue op).
        L.append(f"acc = acc.to({epilogue.TL_DTYPES[s.dtype]})")
        L += s.out.code(p, "acc", "pid_b", rows, cols, ok, s.m, s.n)
        return L
