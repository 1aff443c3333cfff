"""Small @triton.jit helpers generated kernels call: math Triton's core lacks, exact
rounding, and the product's combine function.

On a GPU the transcendental helpers call libdevice (CUDA or ROCm). Triton's interpreter
cannot run libdevice, so the `interpret` target gets forms built from core ops,
computed in fp64 with series near zero where the closed form would cancel. Functions
with no such form here (asin, acos, atan, atan2) are unsupported on `interpret` only.
"""

from __future__ import annotations

from kiln.codegen.expr.values import CodegenUnsupported
from kiln.target import Target

_GPU_LIBDEVICE = {
    "_tanh": "tanh", "_log1p": "log1p", "_expm1": "expm1", "_tan": "tan", "_sinh": "sinh",
    "_cosh": "cosh", "_asin": "asin", "_acos": "acos", "_atan": "atan",
}

_INTERPRET = {
    "_tanh": """
        y = x.to(tl.float64)
        a = tl.abs(y)
        e = tl.exp(-2.0 * a)
        t = tl.where(a < 1e-4, a - a * a * a / 3.0, (1.0 - e) / (1.0 + e))
        return tl.where(y < 0, -t, tl.where(y != y, y, t)).to(x.dtype)""",
    "_log1p": """
        y = x.to(tl.float64)
        r = tl.where(tl.abs(y) < 1e-5, y - 0.5 * y * y + y * y * y / 3.0, tl.log(1.0 + y))
        return r.to(x.dtype)""",
    "_expm1": """
        y = x.to(tl.float64)
        r = tl.where(tl.abs(y) < 1e-5, y + 0.5 * y * y + y * y * y / 6.0, tl.exp(y) - 1.0)
        return r.to(x.dtype)""",
    "_tan": """
        y = x.to(tl.float64)
        return (tl.sin(y) / tl.cos(y)).to(x.dtype)""",
    "_sinh": """
        y = x.to(tl.float64)
        r = tl.where(tl.abs(y) < 1e-5, y + y * y * y / 6.0, (tl.exp(y) - tl.exp(-y)) * 0.5)
        return r.to(x.dtype)""",
    "_cosh": """
        y = x.to(tl.float64)
        return ((tl.exp(y) + tl.exp(-y)) * 0.5).to(x.dtype)""",
}

_POW_GPU = """
@triton.jit
def _pow(x, y):
    return libdevice.pow(x, y)
"""

# pow from exp2/log2 in fp64, with torch's special cases: negative bases with integral
# exponents keep their sign, other negative bases give NaN, x**0 == 1 and 1**y == 1.
_POW_INTERPRET = """
@triton.jit
def _pow(x, y):
    a = x.to(tl.float64)
    b = y.to(tl.float64)
    r = tl.exp2(b * tl.log2(tl.abs(a)))
    whole = tl.floor(b) == b
    odd = whole & (tl.floor(b * 0.5) != b * 0.5)
    r = tl.where((a < 0) & odd, -r, r)
    r = tl.where((a < 0) & (~whole), float("nan"), r)
    r = tl.where((b == 0) | (a == 1), 1.0, r)
    return r.to(x.dtype)
"""

_ATAN2_GPU = """
@triton.jit
def _atan2(x, y):
    return libdevice.atan2(x, y)
"""

_COMMON = {
    # round half to even, exactly (x - floor(x) is exact; no x + 0.5 rounding)
    "_round": """
@triton.jit
def _round(x):
    r = tl.floor(x)
    d = x - r
    up = (d > 0.5) | ((d == 0.5) & (r - 2.0 * tl.floor(r * 0.5) != 0))
    return tl.where(up, r + 1.0, r)
""",
    # fp32 -> bf16 rounding to nearest even on the bits (for the interpreter only)
    "_to_bf16": """
@triton.jit
def _to_bf16(x):
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, u.to(tl.float32, bitcast=True)).to(tl.bfloat16)
""",
    "_trunc": """
@triton.jit
def _trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))
""",
    # torch's div_floor_floating: floor of the exact quotient, nudged like ATen
    "_div_floor": """
@triton.jit
def _div_floor(a, b):
    mod = a % b
    div = (a - mod) / b
    div = tl.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1.0, div)
    fl = tl.floor(div)
    fl = tl.where(div - fl > 0.5, fl + 1.0, fl)
    q = a / b
    res = tl.where(div != 0, fl, tl.where(q < 0, -0.0, 0.0))
    return tl.where(b == 0, q, res)
""",
    # the product's combine function (sum and integer max / min use triton.language's own)
    "_prod": """
@triton.jit
def _prod(a, b):
    return a * b
""",
    # floating max / min as torch has them: a NaN wins (PTX max.NaN, numpy's maximum)
    "_max_nan": """
@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
""",
    "_min_nan": """
@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)
""",
}


def helper_source(name: str, target: Target) -> str:
    """The source of helper `name` for `target`."""
    if name in _COMMON:
        return _COMMON[name]
    gpu = target.backend != "interpret"
    if name == "_pow":
        return _POW_GPU if gpu else _POW_INTERPRET
    if name == "_atan2" and gpu:
        return _ATAN2_GPU
    if gpu and name in _GPU_LIBDEVICE:
        return f"\n@triton.jit\ndef {name}(x):\n    return libdevice.{_GPU_LIBDEVICE[name]}(x)\n"
    if not gpu and name in _INTERPRET:
        body = "\n".join(ln[4:] for ln in _INTERPRET[name].strip("\n").splitlines())
        return f"\n@triton.jit\ndef {name}(x):\n{body}\n"
    raise CodegenUnsupported(f"{name} has no form for target {target}")
