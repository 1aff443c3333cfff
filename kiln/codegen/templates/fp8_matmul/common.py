"""Code the fp8 kernels share: the target's e4m3 type, quantising a tile, reading e4m3fn
bytes on gfx942, and a K split's combine.

Targets: sm_89+ multiply e4m3 on tensor cores; on older GPUs (Triton has no e4m3
there) the templates decline and the ops run as their PyTorch form. gfx942 (MI300) has
e4m3fnuz, not e4m3fn: the same bits are half the value there (e4m3fn's -0 is fnuz's
NaN), so stored e4m3fn bytes (the weight, quantised x) are read as fnuz with their
scale doubled, and x is quantised to fnuz at half its value, which gives exactly
e4m3fn's bytes. Every stored fp8 tensor is e4m3fn, as on every other target.

Triton's interpreter rounds fp32 to fp8 dropping the mantissa carry (1.97 becomes 1.0,
not 2.0): on the interpret target a tile is first rounded to e4m3's grid in fp32 (to
nearest even), so the cast is exact. Divisions are `div_rn`: Triton's `/` on fp32 is
the approximate div.full.f32 on CUDA, and the scales must be torch's to the bit.
"""

from __future__ import annotations

from kiln.codegen.expr.values import CodegenUnsupported
from kiln.codegen.templates import split_k as split
from kiln.ops.fp8_linear import AMAX_FLOOR, FP8_MAX
from kiln.target import Target

E4M3FN = "tl.float8e4nv"


def fp8_type(target: Target) -> str:
    """Triton's e4m3 type the tensor cores multiply on `target`; declines where Triton
    has none (the op then runs as its PyTorch form, with a note)."""
    if target.backend == "hip":
        if target.arch != "gfx942":
            raise CodegenUnsupported(f"{target} has no e4m3 kiln's kernel knows (gfx942's "
                                     "e4m3fnuz only)")
        return "tl.float8e4b8"  # e4m3fnuz: CDNA3's fp8, largest 240
    if target.backend == "cuda" and isinstance(target.arch, int) and target.arch < 89:
        raise CodegenUnsupported(f"{target} has no e4m3: Triton supports fp8e4nv from sm_89")
    return E4M3FN


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def quantise_rows(xf: str, target: Target, axis: int = 1) -> list[str]:
    """Lines quantising the fp32 tile `xf` [rows, 128] per row as kiln.ops.fp8_linear
    does: `xq` (the e4m3fn values, in the target's fp8 type: on gfx942 its e4m3fn
    bytes as fnuz) and `xs` [rows] (amax times fp32(1 / 448)). `axis`: the tile's
    128-wide dim, its last (2 for the GEMV's [1, KB, 128] step of one row)."""
    expand = "[" + ", ".join([":"] * axis + ["None"]) + "]"
    lines = [f"amax = tl.maximum(tl.max(tl.abs({xf}), {axis}), {AMAX_FLOOR!r})",
             f"xs = amax * {1.0 / FP8_MAX!r}  # as the op: times fp32(1 / 448)",
             "# times 448 / amax as torch's `448 / amax`: a reciprocal, then times 448",
             f"xv = {xf} * (tl.math.div_rn(1.0, amax) * {FP8_MAX!r}){expand}",
             f"xv = tl.minimum(tl.maximum(xv, {-FP8_MAX!r}), {FP8_MAX!r})"]
    if target.backend == "interpret":
        lines += round_to_e4m3("xv")
    if target.backend == "hip":  # fnuz at half the value: e4m3fn's bytes
        return lines + [f"xq = (xv * 0.5).to({fp8_type(target)})"]
    return lines + [f"xq = xv.to({E4M3FN})"]


def from_e4m3fn(tile: str, target: Target) -> str:
    """`tile` (loaded e4m3fn bytes) as the target's fp8 operand. On gfx942 the bytes
    are read as fnuz (half the value: the caller doubles the scale) and e4m3fn's -0
    (0x80, fnuz's NaN) becomes 0."""
    if target.backend != "hip":
        return tile
    b = f"{tile}.to(tl.uint8, bitcast=True)"
    return f"tl.where({b} == 128, 0, {b}).to(tl.uint8).to({fp8_type(target)}, bitcast=True)"


def fnuz_scale(target: Target) -> str:
    """The factor an e4m3fn tile's scale takes when its bytes are read as fnuz."""
    return " * 2.0" if target.backend == "hip" else ""


def round_to_e4m3(v: str) -> list[str]:
    """`v` (fp32, |v| <= 448) rounded to nearest even on e4m3's grid, in fp32: the
    spacing is 2^(e - 3) for a value of exponent e, 2^-9 among the subnormals; adding
    and taking away 1.5 * 2^23 rounds a quotient below 2^22 to an integer, to even."""
    return [
        "# the interpreter's fp8 cast drops the mantissa carry: round on e4m3's grid first",
        f"ulp = ({v}.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)",
        "ulp = tl.maximum(ulp * 0.125, 0.001953125)",
        f"{v} = ((({v} / ulp) + 12582912.0) - 12582912.0) * ulp",
    ]


def combine_splits(tile: str, ok: str, gate: str, accs: list[str] | None = None) -> list[str]:
    """With K split: each program stores its [BM, BN] part; the last to arrive sums
    them in split order and alone stores (kiln.codegen.templates.split_k). `tile` is
    the tile's index, `ok` the mask of its real elements, `gate` the line that masks
    the final store with `last`. `accs`: the tiles (default `acc`), stored one after
    another in a part (paired siblings' two)."""
    accs = accs or ["acc"]
    numel = "BM * BN" if len(accs) == 1 else f"{len(accs)} * BM * BN"
    at = ["part_offs"] + [f"{j} * BM * BN + part_offs" for j in range(1, len(accs))]
    offs = "part_offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]"
    store = [offs, *[f"tl.store({split.part(numel)} + {a}, {acc}, mask={ok})"
                     for a, acc in zip(at, accs)]]
    loads = [split.load_part(split.part(numel, "s") + f" + {a}", f"{ok} & (s < n_split)")
             for a in at]
    combine = [f"{acc} = tl.zeros([BM, BN], dtype=tl.float32)" for acc in accs]
    combine += split.merge_loop(numel, [f"{acc} += {load}" for acc, load in zip(accs, loads)])
    return split.arrive("SPLIT_K", tile, store, combine, [gate])
