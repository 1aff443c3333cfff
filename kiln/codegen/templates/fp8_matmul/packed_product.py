"""The one-token fp8 GEMV's products in packed fp16 on NVIDIA GPUs (gemv.py's inner step).

Written in Triton, each weight byte costs three instructions (sm_90 SASS of Llama's
w2 GEMV, 128 weight bytes a thread a step: 64 F2FP e4m3x2 -> f16x2 conversions, 128
HADD2.F32 widening each half to fp32, 128 FFMA), so at an H200's copy rate the GEMV
is close to issue-bound: it streamed at ~1.4x its bytes' time where the bf16 GEMV
(one FMA a 2-byte element) runs at ~1.05x (benchmarks/NOTES.md).

Here the weight is loaded as 32-bit words (four e4m3 bytes each) and one inline-asm
block takes two words: four `cvt.rn.f16x2.e4m3x2`, one `mul.rn.f16x2` and three
`fma.rn.f16x2` against x's quantised values as f16 pairs, then the two fp16 halves
widened to fp32 (12 instructions for 8 bytes, 1.5 a byte). Products of e4m3 values are
exact in fp16 (4 + 4 significant bits) once x is scaled by 2^-4: |w|, |xq| <= 448 make
a product at most 12544 and a sum of four at most 50176, under fp16's 65504; x's
scaled values keep their bits (e4m3's smallest, 2^-9, becomes 2^-13, a normal fp16).
Only products under 2^-14 (fp16's subnormals, 2^27 below the largest possible) and
the three fp16 additions a lane round (~2^-11 relative each), against the 2^-4 of x's
own e4m3 rounding. The block sums then go on in fp32 as before, the 2^4 folded
into x's block scale.

x is quantised per 128-block exactly as common.quantise_rows does, reshaped word by
byte and packed pairwise with `cvt.rn.f16x2.f32`, once a step for all the weight rows.
"""

from __future__ import annotations

from kiln.codegen.templates.fp8_matmul.common import E4M3FN, round_to_e4m3
from kiln.ops.fp8_linear import AMAX_FLOOR, FP8_MAX
from kiln.settings import fp8_gemv_packed
from kiln.target import Target

# x's quantised values times this fit a sum of four products in fp16 (module docstring)
X_SCALE = 0.0625
WORDS = 32  # words a 128-wide scale block

# two words of weight bytes ($2, $3) against x's f16 pairs: $4, $5 hold bytes 0-1 of
# word 0 and word 1, $6, $7 bytes 2-3; out: the two fp16 lanes' sums, widened ($0, $1)
PRODUCT_ASM = """{
.reg .b16 w<4>;
.reg .b32 h<4>, p;
.reg .b16 lo, hi;
mov.b32 {w0, w1}, $2;
mov.b32 {w2, w3}, $3;
cvt.rn.f16x2.e4m3x2 h0, w0;
cvt.rn.f16x2.e4m3x2 h1, w1;
cvt.rn.f16x2.e4m3x2 h2, w2;
cvt.rn.f16x2.e4m3x2 h3, w3;
mul.rn.f16x2 p, h0, $4;
fma.rn.f16x2 p, h1, $6, p;
fma.rn.f16x2 p, h2, $5, p;
fma.rn.f16x2 p, h3, $7, p;
mov.b32 {lo, hi}, p;
cvt.f32.f16 $0, lo;
cvt.f32.f16 $1, hi;
}"""

# two fp32 values as one f16 pair: $1 the lower half (the word's earlier byte), $2 the upper
PAIR_ASM = "cvt.rn.f16x2.f32 $0, $2, $1;"


def packs(target: Target, k_tail: bool) -> bool:  # tests force it on the interpreter
    """Whether the GEMV takes this form: NVIDIA targets (the fp8 template has already
    declined those without e4m3, and with it these conversions: sm_89+), K a whole
    number of steps (no masked words), unless KILN_FP8_GEMV_PACKED=0. gfx942 and the
    interpreter keep the fp32 form."""
    return target.backend == "cuda" and not k_tail and fp8_gemv_packed()


def word_offsets() -> str:
    """The line setting `kw`, a step's [1, KB, 32] word offsets."""
    return (f"kw = tl.arange(0, KB)[None, :, None] * {WORDS} + "
            f"tl.arange(0, {WORDS})[None, None, :]  # [1, KB, 32] a step's 4-byte words")


def quantise_packed(x: str, m: int, target: Target) -> list[str]:
    """Lines quantising row m's fp32 x `x` ([1, KB, 128]) per 128-block as
    common.quantise_rows does, setting `xa{m}`, `xb{m}` ([1, KB, 32]: bytes 0-1 and 2-3
    of each weight word as f16 pairs, times X_SCALE) and `xs{m}` (the block scale over
    X_SCALE)."""
    return [f"amax = tl.maximum(tl.max(tl.abs({x}), 2), {AMAX_FLOOR!r})",
            f"xs{m} = amax * {1.0 / FP8_MAX!r} * {1.0 / X_SCALE!r}",
            f"q = {x} * (tl.math.div_rn(1.0, amax) * {FP8_MAX!r})[:, :, None]",
            f"q = tl.minimum(tl.maximum(q, {-FP8_MAX!r}), {FP8_MAX!r})",
            *(round_to_e4m3("q") if target.backend == "interpret" else []),
            f"q = q.to({E4M3FN}).to(tl.float32) * {X_SCALE!r}",
            "# word by byte: [1, KB, 32, 4] as [.., pair, byte of the pair]",
            f"q_even, q_odd = tl.split(tl.reshape(q, [1, KB, {WORDS}, 2, 2]))",
            f"pairs = {_pair('q_even', 'q_odd', target)}  # [1, KB, 32, 2]",
            f"xa{m}, xb{m} = tl.split(pairs)"]


def _pair(lo: str, hi: str, target: Target) -> str:
    """fp32 `lo`, `hi` as one f16 pair (`hi` the upper half); on the interpreter, which
    runs no PTX, the same bits from Triton's core ops."""
    if target.backend == "interpret":
        return (f"({_f16_bits(hi)} << 16) | {_f16_bits(lo)}")
    return (f"tl.inline_asm_elementwise({PAIR_ASM!r}, '=r,r,r', [{lo}, {hi}], "
            "dtype=tl.int32, is_pure=True, pack=1)")


def _f16_bits(v: str) -> str:
    return f"({v}.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF)"


def product(words: str, m: int, target: Target) -> list[str]:
    """Lines setting `prod`, row m's [BN, KB, 32] fp32 products of the weight's words `words`
    (on the GPU two a word pair, each a sum of four), summed over the block by the
    caller. The interpreter runs no PTX: there each word's four bytes are widened and
    multiplied in fp16 by Triton's core ops, two fp16 sums of two products a word (the
    GPU's grouping differs within fp16 rounding; the pairing of bytes and x's halves,
    which a test holds against the op, is the same)."""
    if target.backend != "interpret":
        return [f"prod = tl.inline_asm_elementwise({PRODUCT_ASM!r}, '=r,=r,r,r,r,r,r,r', "
                f"[{words}, xa{m}, xb{m}], dtype=tl.float32, is_pure=True, pack=2)"]
    byte = [f"(({words} >> {8 * i}) & 0xFF).to(tl.uint8).to({E4M3FN}, bitcast=True)"
            ".to(tl.float16)" for i in range(4)]
    half = [f"(({x} >> {16 * i}) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)"
            for x in (f"xa{m}", f"xb{m}") for i in range(2)]  # xa lo, xa hi, xb lo, xb hi
    return [f"p_lo = {byte[0]} * {half[0]} + {byte[2]} * {half[2]}",
            f"p_hi = {byte[1]} * {half[1]} + {byte[3]} * {half[3]}",
            "prod = p_lo.to(tl.float32) + p_hi.to(tl.float32)"]
