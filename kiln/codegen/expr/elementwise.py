"""Elementwise ATen ops as Triton expressions, with eager PyTorch's numerics.

Each op computes in the dtype PyTorch computes it in (`opmath`: fp16/bf16 math runs in
fp32, integer ops stay integer, comparisons happen in the promoted dtype) and rounds to
its own result dtype, as eager does op by op. Rounding and division follow torch's
definitions (round half to even, `div` floor/trunc modes, `remainder` vs `fmod`,
NaN-propagating max/min/clamp). Functions Triton's core lacks (tanh, log1p, pow, ...)
are small jit helpers (kiln.codegen.expr.jit_helpers) with a GPU form and an
interpreter form.
"""

from __future__ import annotations

import torch

from kiln.codegen.expr.values import TL, CodegenUnsupported, OpEmitter, Val, literal, opmath
from kiln.ir.ops import bind_args
from kiln.ir.plan import Op, Ref, Sym


def _vars(*vals: Val) -> frozenset:
    return frozenset().union(*(v.vars for v in vals if isinstance(v, Val)))


class _Ctx:
    """What an op's rule needs: its operands (cast on request) and a way to finish."""

    def __init__(self, em: OpEmitter, op: Op, index, mask):
        self.em, self.op, self.index, self.mask = em, op, index, mask
        self.a = bind_args(op)

    def raw(self, name: str):
        return self.a[name]

    def get(self, name: str, dtype: torch.dtype | None = None) -> Val | None:
        arg = self.a[name]
        if arg is None:
            return None
        v = self.em.operand(self.op, arg, self.index, self.mask)
        return self.em.cast(v, dtype) if dtype is not None else v

    def let(self, expr: str, dtype: torch.dtype, *vals: Val) -> Val:
        return self.em.let(expr, dtype, _vars(*vals))

    def done(self, expr: str, cdt: torch.dtype, *vals: Val) -> Val:
        """Assign expr (computed in `cdt`) and round it to the op's dtype."""
        return self.em.cast(self.let(expr, cdt, *vals), self.op.dtype)

    @property
    def cdt(self) -> torch.dtype:
        return opmath(self.op.dtype)

    def dtype_of(self, arg) -> torch.dtype | None:
        return self.em.dtype(arg.name) if isinstance(arg, Ref) else None

    def promoted(self, *names: str) -> torch.dtype:
        """torch.result_type of the named arguments (0-dim tensors rank below others)."""
        dummies = []
        for n in names:
            arg = self.a[n]
            if isinstance(arg, Ref):
                rank0 = len(self.em.shape(arg.name)) == 0
                dummies.append(torch.empty(() if rank0 else (1,), dtype=self.em.dtype(arg.name)))
            elif isinstance(arg, Sym):
                dummies.append(1)
            else:
                dummies.append(arg)
        r = dummies[0]
        for d in dummies[1:]:
            r = torch.empty((1,), dtype=torch.result_type(r, d)) if isinstance(r, torch.Tensor) \
                or isinstance(d, torch.Tensor) else d
        return r.dtype if isinstance(r, torch.Tensor) else self.op.dtype


def emit(em: OpEmitter, op: Op, index, mask) -> Val:
    rule = RULES.get(op.target)
    if rule is None:
        raise CodegenUnsupported(f"{op.target} has no Triton rule")
    return rule(_Ctx(em, op, index, mask))


# ---------------------------------------------------------------- rule builders


def _float_unary(fmt: str, helper: str | None = None):
    def rule(c: _Ctx) -> Val:
        cdt = c.cdt
        if not cdt.is_floating_point:
            raise CodegenUnsupported(f"{c.op.target} with result dtype {c.op.dtype}")
        x = c.get("self", cdt)
        if helper:
            c.em.need(helper)
            x = c.em.tensor(x)
        sqrt = "tl.sqrt_rn" if cdt == torch.float32 else "tl.sqrt"
        return c.done(fmt.format(x=x, sqrt=sqrt), cdt, x)
    return rule


def _unary(float_fmt: str, int_fmt: str | None = "{x}", helper: str | None = None):
    """An op defined on floats and ints alike (ints keep their type)."""
    def rule(c: _Ctx) -> Val:
        cdt = c.cdt
        x = c.get("self", cdt)
        if cdt.is_floating_point:
            if helper:
                c.em.need(helper)
                x = c.em.tensor(x)
            return c.done(float_fmt.format(x=x), cdt, x)
        if int_fmt is None:
            raise CodegenUnsupported(f"{c.op.target} on {cdt}")
        return x if int_fmt == "{x}" else c.done(int_fmt.format(x=x), cdt, x)
    return rule


def _binary(fmt: str, bool_fmt: str | None = None, a: str = "self", b: str = "other",
            alpha: bool = False):
    def rule(c: _Ctx) -> Val:
        cdt = c.cdt
        x, y = c.get(a, cdt), c.get(b, cdt)
        if alpha and c.raw("alpha") not in (None, 1):
            y = c.let(f"{y} * {literal(c.raw('alpha'), cdt)}", cdt, y)
        if cdt == torch.bool:
            if bool_fmt is None:
                raise CodegenUnsupported(f"{c.op.target} on bool")
            return c.done(bool_fmt.format(x=x, y=y), cdt, x, y)
        return c.done(fmt.format(x=x, y=y), cdt, x, y)
    return rule


def _compare(sym: str):
    def rule(c: _Ctx) -> Val:
        cdt = opmath(c.promoted("self", "other"))
        x, y = c.get("self", cdt), c.get("other", cdt)
        return c.let(f"{x} {sym} {y}", torch.bool, x, y)
    return rule


def _logical(sym: str):
    def rule(c: _Ctx) -> Val:
        x, y = c.get("self", torch.bool), c.get("other", torch.bool)
        return c.done(f"{x} {sym} {y}", torch.bool, x, y)
    return rule


def _max_min(gt: str):
    def rule(c: _Ctx) -> Val:
        cdt = c.cdt
        x, y = c.get("self", cdt), c.get("other", cdt)
        if cdt == torch.bool:
            return c.done(f"{x} {'|' if gt == '>' else '&'} {y}", cdt, x, y)
        if cdt.is_floating_point:  # NaN in either operand wins, as in torch
            return c.done(f"tl.where(({x} {gt} {y}) | ({x} != {x}), {x}, {y})", cdt, x, y)
        return c.done(f"tl.where({x} {gt} {y}, {x}, {y})", cdt, x, y)
    return rule


def _clamp(lo_name: str | None, hi_name: str | None, lo_default=None, hi_default=None):
    def rule(c: _Ctx) -> Val:
        cdt = c.cdt
        y = c.get("self", cdt)
        for name, default, sym in ((lo_name, lo_default, "<"), (hi_name, hi_default, ">")):
            if name is None:
                continue
            bound = c.get(name, cdt) if c.raw(name) is not None else (
                literal(default, cdt) if default is not None else None)
            if bound is not None:  # NaN in x stays NaN: the comparison is false
                y = c.let(f"tl.where({y} {sym} {bound}, {bound}, {y})", cdt, y, bound)
        return c.em.cast(y, c.op.dtype)
    return rule


# ---------------------------------------------------------------- rules with some logic


def _div(c: _Ctx) -> Val:
    mode = c.raw("rounding_mode") if "rounding_mode" in c.a else None
    cdt = c.cdt
    x, y = c.get("self", cdt), c.get("other", cdt)
    if mode is None:
        return c.done(f"{x} / {y}", cdt, x, y)
    if not cdt.is_floating_point:
        if mode == "trunc":
            return c.done(f"{x} // {y}", cdt, x, y)  # Triton's integer // truncates
        q = c.let(f"{x} // {y}", cdt, x, y)
        return c.done(f"tl.where(({x} % {y} != 0) & (({x} < 0) != ({y} < 0)), {q} - 1, {q})",
                      cdt, q)
    if mode == "trunc":
        c.em.need("_trunc")
        q = c.let(f"{x} / {y}", cdt, x, y)
        return c.done(f"_trunc({c.em.tensor(q)})", cdt, q)
    c.em.need("_div_floor")
    x, y = c.em.tensor(x), c.em.tensor(y)
    return c.done(f"_div_floor({x}, {y})", cdt, x, y)


def _remainder(c: _Ctx) -> Val:
    cdt = c.cdt
    x, y = c.get("self", cdt), c.get("other", cdt)
    r = c.let(f"{x} % {y}", cdt, x, y)
    return c.done(f"tl.where(({r} != 0) & (({r} < 0) != ({y} < 0)), {r} + {y}, {r})", cdt, r, y)


def _int_power(c: _Ctx, x: Val, e: int, cdt) -> Val:
    if e < 0 or e > 64:
        raise CodegenUnsupported(f"integer power {e}")
    if e == 0:
        return c.em.cast(literal(1, cdt), c.op.dtype)
    result, base = None, x
    while e:
        if e & 1:
            result = base if result is None else c.let(f"{result} * {base}", cdt, result, base)
        e >>= 1
        if e:
            base = c.let(f"{base} * {base}", cdt, base)
    return c.em.cast(result, c.op.dtype)


def _pow(c: _Ctx) -> Val:
    cdt = c.cdt
    t = c.op.target
    if t == "aten.pow.Scalar":
        if not cdt.is_floating_point:
            raise CodegenUnsupported("pow.Scalar with an integer result")
        e = c.em.tensor(c.get("exponent", cdt))
        base = c.let(f"tl.full({e}.shape, {literal(c.raw('self'), cdt)}, {_tl(cdt)})", cdt,
                     e)
        c.em.need("_pow")
        return c.done(f"_pow({base}, {e})", cdt, e)
    x = c.get("self", cdt)
    if t == "aten.pow.Tensor_Tensor":
        if not cdt.is_floating_point:
            raise CodegenUnsupported("pow.Tensor_Tensor on integers")
        x, e = c.em.tensor(x), c.em.tensor(c.get("exponent", cdt))
        c.em.need("_pow")
        return c.done(f"_pow({x}, {e})", cdt, x, e)
    e = c.raw("exponent")
    if not cdt.is_floating_point:
        if float(e) != int(e):
            raise CodegenUnsupported("integer pow with a fractional exponent")
        return _int_power(c, x, int(e), cdt)
    special = {2: "{x} * {x}", 3: "{x} * {x} * {x}", 1: "{x}", 0.5: "{sqrt}({x})",
               -0.5: "1.0 / {sqrt}({x})", -1: "1.0 / {x}", -2: "1.0 / ({x} * {x})"}
    if e == 0:
        return c.em.cast(literal(1.0, cdt), c.op.dtype)
    if e in special:
        sqrt = "tl.sqrt_rn" if cdt == torch.float32 else "tl.sqrt"
        return c.done(special[e].format(x=x, sqrt=sqrt), cdt, x)
    c.em.need("_pow")
    x = c.em.tensor(x)
    ev = c.let(f"tl.full({x}.shape, {literal(e, cdt)}, {_tl(cdt)})", cdt, x)
    return c.done(f"_pow({x}, {ev})", cdt, x)


def _tl(dt: torch.dtype) -> str:
    return TL[dt]


def _where(c: _Ctx) -> Val:
    cond = c.get("condition", torch.bool)
    x, y = c.get("self", c.op.dtype), c.get("other", c.op.dtype)
    return c.let(f"tl.where({cond}, {x}, {y})", c.op.dtype, cond, x, y)


def _masked_fill(c: _Ctx) -> Val:
    m = c.get("mask", torch.bool)
    x, v = c.get("self", c.op.dtype), c.get("value", c.op.dtype)
    return c.let(f"tl.where({m}, {v}, {x})", c.op.dtype, m, x, v)


def _to_dtype(c: _Ctx) -> Val:
    name = "src" if c.op.target == "aten.copy.default" else "self"
    return c.em.cast(c.get(name), c.op.dtype)


def _lerp(c: _Ctx) -> Val:
    cdt = c.cdt
    s, e, w = c.get("self", cdt), c.get("end", cdt), c.get("weight", cdt)
    d = c.let(f"{e} - {s}", cdt, s, e)
    return c.done(f"tl.where(tl.abs({w}) < 0.5, {s} + {w} * {d}, {e} - {d} * (1.0 - {w}))",
                  cdt, d, w, s, e)


def _gelu(c: _Ctx) -> Val:
    cdt = c.cdt
    x = c.get("self", cdt)
    if c.raw("approximate") == "tanh":
        c.em.need("_tanh")
        inner = f"0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})"
        return c.done(f"0.5 * {x} * (1.0 + _tanh({inner}))", cdt, x)
    return c.done(f"0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476))", cdt, x)


def _softplus(c: _Ctx) -> Val:
    cdt = c.cdt
    x = c.get("self", cdt)
    beta, thr = literal(c.raw("beta"), cdt), literal(c.raw("threshold"), cdt)
    c.em.need("_log1p")
    return c.done(f"tl.where({x} * {beta} > {thr}, {x}, _log1p(tl.exp({x} * {beta})) / {beta})",
                  cdt, x)


def _elu(c: _Ctx) -> Val:
    cdt = c.cdt
    x = c.get("self", cdt)
    alpha, scale = literal(c.raw("alpha"), cdt), literal(c.raw("scale"), cdt)
    in_scale = literal(c.raw("input_scale"), cdt)
    c.em.need("_expm1")
    return c.done(f"tl.where({x} > 0, {x} * {scale}, _expm1({x} * {in_scale}) * {alpha} * "
                  f"{scale})", cdt, x)


def _logit(c: _Ctx) -> Val:
    cdt = c.cdt
    x = c.get("self", cdt)
    eps = c.raw("eps")
    if eps is not None:
        lo, hi = literal(eps, cdt), literal(1.0 - eps, cdt)
        x = c.let(f"tl.where({x} < {lo}, {lo}, tl.where({x} > {hi}, {hi}, {x}))", cdt, x)
    return c.done(f"tl.log({x} / (1.0 - {x}))", cdt, x)


def _leaky_relu(c: _Ctx) -> Val:
    cdt = c.cdt
    x = c.get("self", cdt)
    s = literal(c.raw("negative_slope"), cdt)
    return c.done(f"tl.where({x} > 0, {x}, {x} * {s})", cdt, x)


def _sign(c: _Ctx) -> Val:
    cdt = c.cdt
    x = c.get("self", cdt)
    if cdt == torch.bool:
        return x
    one, neg, zero = (literal(v, cdt) for v in (1, -1, 0))
    return c.done(f"tl.where({x} > 0, {one}, tl.where({x} < 0, {neg}, {zero}))", cdt, x)


def _isnan(c: _Ctx) -> Val:
    x = c.get("self")
    return c.let(f"{x} != {x}", torch.bool, x)


def _isinf(c: _Ctx) -> Val:
    x = c.get("self")
    if not x.dtype.is_floating_point:
        return c.let(f"{x} != {x}", torch.bool, x)
    return c.let(f'tl.abs({x}) == float("inf")', torch.bool, x)


def _logical_not(c: _Ctx) -> Val:
    x = c.get("self", torch.bool)
    return c.done(f"~{x}", torch.bool, x)


def _bitwise_not(c: _Ctx) -> Val:
    x = c.get("self", c.op.dtype)
    return c.let(f"~{x}", c.op.dtype, x)


def _neg(c: _Ctx) -> Val:
    x = c.get("self", c.cdt)
    return c.done(f"-{x}", c.cdt, x)


def _helper_unary(name: str):
    return _float_unary(f"{name}({{x}})", helper=name)


def _helper_binary(name: str):
    def rule(c: _Ctx) -> Val:
        cdt = c.cdt
        x, y = c.em.tensor(c.get("self", cdt)), c.em.tensor(c.get("other", cdt))
        c.em.need(name)
        return c.done(f"{name}({x}, {y})", cdt, x, y)
    return rule


RULES = {
    # arithmetic
    "aten.add.Tensor": _binary("{x} + {y}", "{x} | {y}", alpha=True),
    "aten.add.Scalar": _binary("{x} + {y}", "{x} | {y}", alpha=True),
    "aten.sub.Tensor": _binary("{x} - {y}", alpha=True),
    "aten.sub.Scalar": _binary("{x} - {y}", alpha=True),
    "aten.rsub.Scalar": _binary("{y} - {x}", alpha=True),
    "aten.rsub.Tensor": _binary("{y} - {x}", alpha=True),
    "aten.mul.Tensor": _binary("{x} * {y}", "{x} & {y}"),
    "aten.mul.Scalar": _binary("{x} * {y}", "{x} & {y}"),
    "aten.div.Tensor": _div, "aten.div.Scalar": _div,
    "aten.div.Tensor_mode": _div, "aten.div.Scalar_mode": _div,
    "aten.fmod.Tensor": _binary("{x} % {y}"), "aten.fmod.Scalar": _binary("{x} % {y}"),
    "aten.remainder.Tensor": _remainder, "aten.remainder.Scalar": _remainder,
    "aten.pow.Tensor_Scalar": _pow, "aten.pow.Tensor_Tensor": _pow, "aten.pow.Scalar": _pow,
    "aten.maximum.default": _max_min(">"), "aten.minimum.default": _max_min("<"),
    "aten.neg.default": _neg,
    "aten.abs.default": _unary("tl.abs({x})", "tl.abs({x})"),
    "aten.reciprocal.default": _float_unary("1.0 / {x}"),
    "aten.lerp.Scalar": _lerp, "aten.lerp.Tensor": _lerp,
    # transcendental
    "aten.exp.default": _float_unary("tl.exp({x})"),
    "aten.exp2.default": _float_unary("tl.exp2({x})"),
    "aten.log.default": _float_unary("tl.log({x})"),
    "aten.log2.default": _float_unary("tl.log2({x})"),
    "aten.sqrt.default": _float_unary("{sqrt}({x})"),
    "aten.rsqrt.default": _float_unary("tl.rsqrt({x})"),
    "aten.sin.default": _float_unary("tl.sin({x})"),
    "aten.cos.default": _float_unary("tl.cos({x})"),
    "aten.erf.default": _float_unary("tl.erf({x})"),
    "aten.sigmoid.default": _float_unary("1.0 / (1.0 + tl.exp(-{x}))"),
    "aten.silu.default": _float_unary("{x} / (1.0 + tl.exp(-{x}))"),
    "aten.gelu.default": _gelu,
    "aten.tanh.default": _helper_unary("_tanh"),
    "aten.log1p.default": _helper_unary("_log1p"),
    "aten.expm1.default": _helper_unary("_expm1"),
    "aten.tan.default": _helper_unary("_tan"),
    "aten.sinh.default": _helper_unary("_sinh"),
    "aten.cosh.default": _helper_unary("_cosh"),
    "aten.asin.default": _helper_unary("_asin"),
    "aten.acos.default": _helper_unary("_acos"),
    "aten.atan.default": _helper_unary("_atan"),
    "aten.atan2.default": _helper_binary("_atan2"),
    "aten.softplus.default": _softplus,
    "aten.elu.default": _elu,
    "aten.logit.default": _logit,
    # rounding and sign
    "aten.floor.default": _unary("tl.floor({x})"),
    "aten.ceil.default": _unary("tl.ceil({x})"),
    "aten.trunc.default": _unary("_trunc({x})", helper="_trunc"),
    "aten.round.default": _unary("_round({x})", helper="_round"),
    "aten.sign.default": _sign,
    "aten.relu.default": _unary("tl.where({x} < 0, 0.0, {x})", "tl.where({x} < 0, 0, {x})"),
    "aten.leaky_relu.default": _leaky_relu,
    "aten.hardtanh.default": _clamp("min_val", "max_val", -1.0, 1.0),
    "aten.clamp.default": _clamp("min", "max"),
    "aten.clamp.Tensor": _clamp("min", "max"),
    "aten.clamp_min.default": _clamp("min", None),
    "aten.clamp_max.default": _clamp(None, "max"),
    # comparisons and logic
    "aten.eq.Tensor": _compare("=="), "aten.eq.Scalar": _compare("=="),
    "aten.ne.Tensor": _compare("!="), "aten.ne.Scalar": _compare("!="),
    "aten.lt.Tensor": _compare("<"), "aten.lt.Scalar": _compare("<"),
    "aten.le.Tensor": _compare("<="), "aten.le.Scalar": _compare("<="),
    "aten.gt.Tensor": _compare(">"), "aten.gt.Scalar": _compare(">"),
    "aten.ge.Tensor": _compare(">="), "aten.ge.Scalar": _compare(">="),
    "aten.logical_and.default": _logical("&"), "aten.logical_or.default": _logical("|"),
    "aten.logical_xor.default": _logical("^"), "aten.logical_not.default": _logical_not,
    "aten.bitwise_and.Tensor": _binary("{x} & {y}", "{x} & {y}"),
    "aten.bitwise_and.Scalar": _binary("{x} & {y}", "{x} & {y}"),
    "aten.bitwise_or.Tensor": _binary("{x} | {y}", "{x} | {y}"),
    "aten.bitwise_or.Scalar": _binary("{x} | {y}", "{x} | {y}"),
    "aten.bitwise_xor.Tensor": _binary("{x} ^ {y}", "{x} ^ {y}"),
    "aten.bitwise_not.default": _bitwise_not,
    "aten.isnan.default": _isnan, "aten.isinf.default": _isinf,
    # selection and casts
    "aten.where.self": _where, "aten.where.ScalarSelf": _where,
    "aten.where.ScalarOther": _where,
    "aten.masked_fill.Scalar": _masked_fill, "aten.masked_fill.Tensor": _masked_fill,
    "aten._to_copy.default": _to_dtype, "aten.copy.default": _to_dtype,
}

