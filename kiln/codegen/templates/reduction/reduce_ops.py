"""Each reduction ATen op as accumulators over a row, and the values it yields.

A `Sweep` is a set of accumulators computed in one pass over the row; an op needing
a statistic of a statistic takes several: var and layer_norm reduce the mean first,
then the squared deviations from it (two exact passes, no cancellation); softmax
reduces the max, then the sum of exp(x - max). An op yields row values (sum, mean,
amax, argmax, var, layer_norm's mean and rstd) and, for softmax, log_softmax and
layer_norm's output, per-element values computed from the row values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kiln.codegen.expr.emit import Emitter
from kiln.codegen.expr.values import TL, CodegenUnsupported, Val, literal, opmath
from kiln.ir.ops import bind_args
from kiln.ir.plan import Op, Ref

# per element: (index, mask) -> Val
ElemFn = Callable[[tuple, frozenset], Val]


@dataclass
class Acc:
    """One accumulator: reduce `value` (per element) with `kind` in `dtype`."""

    kind: str  # sum | prod | max | min | any | all | argmax | argmin | lse
    dtype: torch.dtype
    value: ElemFn
    result: Val | None = None  # the row value, once reduced (lse: the max M)
    index: Val | None = None  # argmax / argmin: the position
    total: Val | None = None  # lse: sum(exp(x - M))
    var: str = ""  # looped kernels: the [XBLOCK, RBLOCK] accumulator's name
    index_var: str = ""  # ... argmax / argmin: positions; lse: the rescaled sums


@dataclass
class Sweep:
    """Accumulators reduced in one sweep; `after` then derives row values from them (the
    kernel calls it in the row's scope, outside any loop over the row)."""

    accs: list[Acc]
    after: Callable[[], None] | None = None


@dataclass
class OpPlan:
    op: Op
    stages: list[Sweep]
    rows: dict[str, Callable[[], Val]] = field(default_factory=dict)  # output -> row value
    elems: dict[str, ElemFn] = field(default_factory=dict)  # output -> per-element value


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.int32 if dtype == torch.bool else opmath(dtype)


def _outputs(op: Op, getitems: dict[str, list[tuple[int, str]]]) -> dict[int, str]:
    """Output position -> the name its readers use (the op, or its getitems)."""
    if op.shape is not None:
        return {0: op.name}
    return {k: name for k, name in getitems.get(op.name, [])}


def plan_op(op: Op, em: Emitter, n_code: str, getitems, online: bool = False) -> OpPlan:
    """The accumulators and the yielded values of reduction op `op`.

    `n_code` is the reduced element count in code (a literal or a size parameter);
    `online`: the kernel sweeps the row in chunks (softmax then fuses max and sum).
    """
    t = op.target.removeprefix("aten.")
    src = op.args[0]
    if not isinstance(src, Ref):
        raise CodegenUnsupported(f"{op.target} of a non-tensor")
    in_dtype = em.dtype(src.name)
    outs = _outputs(op, getitems)

    def x(dtype: torch.dtype) -> ElemFn:
        return lambda idx, mask: em.cast(em.value(src.name, idx, mask), dtype)

    def cast_to(name: str, v: Callable[[], Val]) -> Callable[[], Val]:
        return lambda: em.cast(v(), em.dtype(name))

    def plain(kind: str, dtype: torch.dtype) -> OpPlan:
        a = Acc(kind, dtype, x(dtype))
        return OpPlan(op, [Sweep([a])], {outs[0]: cast_to(outs[0], lambda: a.result)})

    name = t.split(".")[0]
    if name in ("sum", "prod"):
        return plain(name, _acc_dtype(op.dtype))
    if name in ("amax", "amin") or t in ("max.default", "min.default"):
        return plain("max" if name in ("amax", "max") else "min", _acc_dtype(in_dtype))
    if name in ("any", "all"):
        a = Acc(name, torch.int32, lambda idx, mask: em.cast(
            em.cast(em.value(src.name, idx, mask), torch.bool), torch.int32))
        return OpPlan(op, [Sweep([a])], {outs[0]: cast_to(outs[0], lambda: a.result)})
    if name == "mean":
        dt = opmath(op.dtype)
        a = Acc("sum", dt, x(dt))
        return OpPlan(op, [Sweep([a])], {outs[0]: cast_to(outs[0], lambda: em.let(
            f"{a.result} / {n_code}", dt, a.result.vars))})
    if name in ("argmax", "argmin") or t in ("max.dim", "min.dim"):
        kind = "argmax" if name in ("argmax", "max") else "argmin"
        dt = _acc_dtype(in_dtype)
        a = Acc(kind, dt, x(dt))
        rows = {}
        if name in ("argmax", "argmin"):
            rows[outs[0]] = cast_to(outs[0], lambda: a.index)
        else:
            if 0 in outs:
                rows[outs[0]] = cast_to(outs[0], lambda: a.result)
            if 1 in outs:
                rows[outs[1]] = cast_to(outs[1], lambda: a.index)
        return OpPlan(op, [Sweep([a])], rows)
    if name in ("var", "var_mean"):
        return _variance(op, em, n_code, outs, x, t)
    if name in ("_softmax", "_log_softmax", "logsumexp"):
        return _softmax(op, em, outs, x, name, online)
    if name == "native_layer_norm":
        return _layer_norm(op, em, n_code, outs, x)
    if name == "linalg_vector_norm":
        return _vector_norm(op, em, outs, x)
    raise CodegenUnsupported(f"reduction {op.target} is not generated")


def _mean_then_squares(em: Emitter, n_code: str, x, dt) -> tuple[Sweep, Acc, Callable]:
    """The first sweep sums x and derives the mean; the returned Acc sums (x - mean)**2."""
    s = Acc("sum", dt, x(dt))
    box: list[Val] = []

    def mean() -> Val:
        return box[0]

    def sq_dev(idx, mask):
        v = x(dt)(idx, mask)
        d = em.let(f"{v} - {mean()}", dt, v.vars | mean().vars)
        return em.let(f"{d} * {d}", dt, d.vars)

    stage = Sweep([s], lambda: box.append(em.let(f"{s.result} / {n_code}", dt, s.result.vars)))
    return stage, Acc("sum", dt, sq_dev), mean


def _variance(op: Op, em: Emitter, n_code: str, outs, x, t: str) -> OpPlan:
    dt = opmath(op.dtype if op.dtype is not None else em.dtype(op.args[0].name))
    a = bind_args(op)
    if t == "var.dim":
        correction = 1 if a["unbiased"] else 0
    else:
        correction = 1 if a["correction"] is None else a["correction"]
    first, ssd, mean = _mean_then_squares(em, n_code, x, dt)

    def var() -> Val:  # torch divides by max(0, N - correction)
        if n_code.isdigit():
            denom = repr(float(max(int(n_code) - correction, 0)))
        else:
            denom = f"tl.maximum({n_code} - {correction!r}, 0).to({TL[dt]})"
        return em.let(f"{ssd.result} / {denom}", dt, ssd.result.vars)

    rows = {}
    if 0 in outs:
        rows[outs[0]] = lambda: em.cast(var(), em.dtype(outs[0]))
    if 1 in outs and t.startswith("var_mean"):
        rows[outs[1]] = lambda: em.cast(mean(), em.dtype(outs[1]))
    return OpPlan(op, [first, Sweep([ssd])], rows)


def _softmax(op: Op, em: Emitter, outs, x, name: str, online: bool) -> OpPlan:
    """softmax, log_softmax and logsumexp from the row max M and S = sum(exp(x - M)).

    Whole rows reduce M, then S (two exact steps over registers). Looped rows reduce
    both in one sweep (`lse`: a running max with the sum rescaled when it grows), so
    softmax reads its input twice, not three times. Softmax multiplies by 1/S (within
    an ulp of dividing, and a third of the instructions).
    """
    dt = opmath(op.dtype)
    row: dict[str, Val] = {}

    def shift_of(m: Val) -> Val:  # logsumexp's max with infinities replaced by 0, as torch
        if name != "logsumexp":
            return m
        return em.let(f'tl.where(tl.abs({m}) == float("inf"), 0.0, {m})', dt, m.vars)

    def exp_shifted(idx, mask):
        v = x(dt)(idx, mask)
        return em.let(f"tl.exp({v} - {row['shift']})", dt, v.vars | row["shift"].vars)

    if online:
        stats = Acc("lse", dt, x(dt))

        def derive():
            row["max"], row["sum"] = stats.result, stats.total
            row["shift"] = row["max"]
            row["inv"] = em.let(f"1.0 / {row['sum']}", dt, row["sum"].vars)

        stages = [Sweep([stats], derive)]
    else:
        m = Acc("max", dt, x(dt))
        total = Acc("sum", dt, exp_shifted)

        def derive_shift():
            row["max"] = m.result
            row["shift"] = shift_of(m.result)

        def derive_sum():
            row["sum"] = total.result
            row["inv"] = em.let(f"1.0 / {row['sum']}", dt, row["sum"].vars)

        stages = [Sweep([m], derive_shift), Sweep([total], derive_sum)]
    plan = OpPlan(op, stages)
    if name == "logsumexp":
        def lse() -> Val:
            r = em.let(f"tl.log({row['sum']}) + {row['shift']}", dt, row["sum"].vars)
            if online:  # a +inf max makes S NaN; torch's answer is +inf
                r = em.let(f'tl.where({row["max"]} == float("inf"), {row["max"]}, {r})', dt,
                           r.vars)
            return em.cast(r, op.dtype)
        plan.rows[outs[0]] = lse
    elif name == "_softmax":  # times the row's 1/S: a multiply, not a divide, per element
        plan.elems[outs[0]] = lambda idx, mask: em.cast(em.let(
            f"{exp_shifted(idx, mask)} * {row['inv']}", dt, row["sum"].vars), op.dtype)
    else:
        def log_softmax(idx, mask):
            v = x(dt)(idx, mask)
            return em.cast(em.let(f"{v} - {row['max']} - tl.log({row['sum']})", dt,
                                  v.vars | row["sum"].vars), op.dtype)
        plan.elems[outs[0]] = log_softmax
    return plan


def _layer_norm(op: Op, em: Emitter, n_code: str, outs, x) -> OpPlan:
    in_dtype = em.dtype(op.args[0].name)
    dt = opmath(in_dtype)
    a = bind_args(op)
    weight, bias = a["weight"], a["bias"]
    eps = 1e-5 if a["eps"] is None else a["eps"]
    norm_rank = len(a["normalized_shape"])
    first, ssd, mean = _mean_then_squares(em, n_code, x, dt)
    box: list[Val] = []

    def rstd() -> Val:
        return box[0]

    def derive_rstd():
        box.append(em.let(f"tl.rsqrt({ssd.result} / {n_code} + {literal(eps, dt)})", dt,
                          ssd.result.vars))

    def out(idx, mask):
        v = x(dt)(idx, mask)
        y = em.let(f"({v} - {mean()}) * {rstd()}", dt, v.vars | ssd.result.vars)
        tail = tuple(idx[len(idx) - norm_rank:])
        for param, sym in ((weight, "*"), (bias, "+")):
            if isinstance(param, Ref):
                p = em.cast(em.value(param.name, tail, mask), dt)
                y = em.let(f"{y} {sym} {p}", dt, y.vars | p.vars)
        return em.cast(y, in_dtype)

    plan = OpPlan(op, [first, Sweep([ssd], derive_rstd)])
    if 0 in outs:
        plan.elems[outs[0]] = out
    if 1 in outs:
        plan.rows[outs[1]] = lambda: em.cast(mean(), em.dtype(outs[1]))
    if 2 in outs:
        plan.rows[outs[2]] = lambda: em.cast(rstd(), em.dtype(outs[2]))
    return plan


def _vector_norm(op: Op, em: Emitter, outs, x) -> OpPlan:
    """torch.linalg.vector_norm: max|x| (ord inf), min|x| (-inf), count of nonzeros (0),
    sum|x| (1), sqrt(sum x**2) (2), else (sum |x|**p) ** (1/p)."""
    ord_ = float(bind_args(op)["ord"])
    dt = opmath(op.dtype)

    def term(fmt: str) -> ElemFn:
        def f(idx, mask):
            v = x(dt)(idx, mask)
            return em.let(fmt.format(v=v), dt, v.vars)
        return f

    if ord_ in (float("inf"), float("-inf")):
        a = Acc("max" if ord_ > 0 else "min", dt, term("tl.abs({v})"))
        return OpPlan(op, [Sweep([a])], {outs[0]: lambda: em.cast(a.result, op.dtype)})
    if ord_ == 0:
        a = Acc("sum", dt, term("({v} != 0).to(tl.float32)"))
        return OpPlan(op, [Sweep([a])], {outs[0]: lambda: em.cast(a.result, op.dtype)})
    if ord_ == 1:
        a = Acc("sum", dt, term("tl.abs({v})"))
        return OpPlan(op, [Sweep([a])], {outs[0]: lambda: em.cast(a.result, op.dtype)})
    if ord_ == 2:
        a = Acc("sum", dt, term("{v} * {v}"))
        sqrt = "tl.sqrt_rn" if dt == torch.float32 else "tl.sqrt"
        return OpPlan(op, [Sweep([a])], {outs[0]: lambda: em.cast(
            em.let(f"{sqrt}({a.result})", dt, a.result.vars), op.dtype)})
    em.need("_pow")
    p = literal(ord_, dt)
    a = Acc("sum", dt, term(f"_pow(tl.abs({{v}}), tl.full({{v}}.shape, {p}, {TL[dt]}))"))
    inv = literal(1.0 / ord_, dt)
    return OpPlan(op, [Sweep([a])], {outs[0]: lambda: em.cast(em.let(
        f"_pow({a.result}, tl.full({a.result}.shape, {inv}, {TL[dt]}))", dt, a.result.vars),
        op.dtype)})
