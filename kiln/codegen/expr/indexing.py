"""Index maps: where an element of a region value lives, as simplified integer expressions.

Inside a region every view (reshape, permute, expand, slice, select, squeeze, ...) is an
index map: reading element `i` of the view reads element `f(i)` of its source. kiln
composes those maps symbolically, down to a flat offset into the source's contiguous
row-major buffer, and prints the result as Triton code.

An index is a tuple of `Lin`s, one per dim: integer linear forms `c0 + sum(ci * atom)`
whose coefficients are `Dim`s (ints or sympy expressions over the model's size symbols)
and whose atoms are

- `Var(name, size)`: a kernel index variable (`xindex`, `rindex`, a tile's `offs_m`)
  taking values in [0, size);
- `Opaque(code, size)`: a data-dependent index already computed in the kernel (a token
  id loaded for an embedding), assumed valid for a dim of `size`;
- `Div(L, d)` = floor(L / d) and `ModIdx(L, d, m)` = floor(L / d) mod m.

Constructors simplify as they build (the rules TorchInductor uses): terms divisible by
a divisor move out of a floor division, a remainder provably below its modulus drops
the mod, nested divisions fuse, and `m * Div(L, d*m) + ModIdx(L, d, m)` recombines into
`Div(L, d)`. So `linearize(delinearize(x, shape), shape)` is `x` again, and a
contiguous access prints as `xindex`: Triton sees it and vectorises the load.

Range facts used by the rules hold on the lanes a kernel keeps (its mask); lanes beyond
a tail may compute other offsets, which are never dereferenced.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import sympy

from kiln.codegen.expr.unsupported import CodegenUnsupported
from kiln.ir.symbolic import Bounds, Dim, as_dim, same_dim, upper_bound

INT32_MAX = 2**31 - 1
# A block's lanes run up to one block past the last element before the mask cuts them;
# sizes within this margin of INT32_MAX index in 64 bits so those lanes cannot wrap.
BLOCK_MARGIN = 2**16


# ---------------------------------------------------------------- dim arithmetic


def _memo(fn):
    """`fn`, a pure function of sizes, remembered: a model's layers ask the same sympy
    questions of the same sizes, and expand / cancel cost tens of microseconds each."""
    cached = functools.lru_cache(maxsize=1 << 14)(fn)

    @functools.wraps(fn)
    def call(*args):
        try:
            return cached(*args)
        except TypeError:  # an unhashable argument (a torch SymInt): computed, not kept
            return fn(*args)

    return call


@_memo
def norm(c) -> Dim:
    """A Dim in canonical form: an int when constant, else an expanded sympy expr."""
    if isinstance(c, int):
        return c
    return as_dim(sympy.expand(c))


def is_zero(c: Dim) -> bool:
    return norm(c) == 0


@_memo
def exact_div(c: Dim, d: Dim) -> Dim | None:
    """c / d when d divides c (as polynomials with integer coefficients), else None."""
    if isinstance(c, int) and isinstance(d, int):
        return c // d if d != 0 and c % d == 0 else None
    q = sympy.cancel(sympy.sympify(c) / sympy.sympify(d))
    _, den = sympy.fraction(sympy.together(q))
    if den != 1:
        return None
    q = sympy.expand(q)
    if not all(coef.is_Integer for coef in q.as_coefficients_dict().values()):
        return None
    return as_dim(q)


@_memo
def known_nonneg(e) -> bool:
    """Is `e` >= 0 for every value of its (positive) size symbols? False when unsure."""
    if isinstance(e, int):
        return e >= 0
    e = sympy.together(sympy.sympify(e))
    num, den = sympy.fraction(e)
    return _poly_nonneg(num) and _poly_positive(den)


def _poly_nonneg(e) -> bool:
    """A polynomial in sizes (each >= 1) is >= 0 if, written in (size - 1), its
    coefficients all are: a sufficient test that decides every case indexing meets."""
    e = sympy.expand(e)
    if e.is_number:
        return bool(e >= 0)
    if all(c >= 0 for c in e.as_coefficients_dict().values()):
        return True
    shifted = sympy.expand(e.xreplace({s: s + 1 for s in e.free_symbols}))
    return all(c >= 0 for c in shifted.as_coefficients_dict().values())


def _poly_positive(e) -> bool:
    e = sympy.expand(e)
    if e.is_number:
        return bool(e > 0)
    return _poly_nonneg(e - 1)


@_memo
def known_lt(a: Dim | None, b: Dim) -> bool:
    """Is a < b for every value of the size symbols? (a None, unknown, is never.)"""
    if a is None:
        return False
    if isinstance(a, int) and isinstance(b, int):
        return a < b
    return known_nonneg(sympy.sympify(b) - sympy.sympify(a) - 1)


# ---------------------------------------------------------------- atoms and linear forms


@dataclass(frozen=True)
class Var:
    """A kernel index variable: Triton code `name`, values in [0, size) (None: unknown)."""

    name: str
    size: Dim | None
    block: bool = True  # a Triton tensor (tl.arange based); False: a scalar (program id)

    def var_names(self) -> frozenset:
        return frozenset((self.name,)) if self.block else frozenset()

    def max(self) -> Dim | None:
        return None if self.size is None else norm(self.size - 1)

    def code(self, dim_code) -> str:
        return self.name


@dataclass(frozen=True)
class Opaque:
    """A data-dependent index computed in the kernel (`code`), valid for a dim of `size`."""

    code_: str
    size: Dim | None
    vars: frozenset = frozenset()  # the block variables the value varies with

    def var_names(self) -> frozenset:
        return self.vars

    def max(self) -> Dim | None:
        return None if self.size is None else norm(self.size - 1)

    def code(self, dim_code) -> str:
        return self.code_


@dataclass(frozen=True)
class Div:
    """floor(lin / d), d > 0."""

    lin: Lin
    d: Dim

    def var_names(self) -> frozenset:
        return self.lin.var_names()

    def max(self) -> Dim | None:
        hi = self.lin.bounds()[1]
        if hi is None:
            return None
        q = exact_div(hi, self.d)
        if q is not None:
            return q
        if isinstance(hi, int) and isinstance(self.d, int):
            return hi // self.d
        return sympy.sympify(hi) / sympy.sympify(self.d)  # an upper bound of the floor

    def code(self, dim_code) -> str:
        return f"({self.lin.code(dim_code)}) // {dim_code(self.d)}"


@dataclass(frozen=True)
class ModIdx:
    """floor(lin / d) mod m, d > 0, m > 0 (lin >= 0 on the lanes that matter)."""

    lin: Lin
    d: Dim
    m: Dim

    def var_names(self) -> frozenset:
        return self.lin.var_names()

    def max(self) -> Dim | None:
        return norm(self.m - 1)

    def code(self, dim_code) -> str:
        inner = self.lin.code(dim_code)
        if not same_dim(self.d, 1):
            inner = f"({inner}) // {dim_code(self.d)}"
        return f"({inner}) % {dim_code(self.m)}"


Atom = Var | Opaque | Div | ModIdx


@_memo
def _atom_key(a: Atom) -> str:
    return repr(a)


@dataclass(frozen=True)
class Lin:
    """const + sum(coeff * atom): an integer index expression in canonical form."""

    terms: tuple[tuple[Atom, Dim], ...] = ()
    const: Dim = 0

    # construction ---------------------------------------------------------
    @staticmethod
    def of(x) -> Lin:
        if isinstance(x, Lin):
            return x
        if isinstance(x, (Var, Opaque, Div, ModIdx)):
            return Lin(((x, 1),), 0)
        return Lin((), norm(x))

    @staticmethod
    def build(terms: dict, const: Dim) -> Lin:
        return _recombine({a: norm(c) for a, c in terms.items() if not is_zero(c)}, norm(const))

    def __add__(self, other) -> Lin:
        other = Lin.of(other)
        terms = dict(self.terms)
        for a, c in other.terms:
            terms[a] = terms.get(a, 0) + c
        return Lin.build(terms, self.const + other.const)

    __radd__ = __add__

    def __sub__(self, other) -> Lin:
        return self + Lin.of(other) * -1

    def __mul__(self, k: Dim) -> Lin:
        if isinstance(k, Lin):
            if k.terms:
                raise TypeError("index expressions stay linear: multiply by a size only")
            k = k.const
        return Lin.build({a: c * k for a, c in self.terms}, self.const * k)

    __rmul__ = __mul__

    # queries --------------------------------------------------------------
    @property
    def is_const(self) -> bool:
        return not self.terms

    def var_names(self) -> frozenset:
        """Names of the block variables this expression varies with."""
        out: frozenset = frozenset()
        for a, _ in self.terms:
            out |= a.var_names()
        return out

    @property
    def block(self) -> bool:
        return bool(self.var_names())

    def bounds(self) -> tuple[Dim | None, Dim | None]:
        """Symbolic (lo, hi) of this expression over its atoms' ranges; None if unknown."""
        lo: Dim | None = self.const
        hi: Dim | None = self.const
        for a, c in self.terms:
            amax = a.max()
            if known_nonneg(c):
                hi = None if hi is None or amax is None else norm(hi + c * amax)
            elif known_nonneg(-sympy.sympify(c)):
                lo = None if lo is None or amax is None else norm(lo + c * amax)
            else:
                return None, None
        return lo, hi

    def nonneg(self) -> bool:
        lo = self.bounds()[0]
        return lo is not None and known_nonneg(lo)

    def below(self, d: Dim) -> bool:
        """0 <= self < d on every lane that matters?"""
        lo, hi = self.bounds()
        return lo is not None and known_nonneg(lo) and known_lt(hi, d)

    def equals(self, other) -> bool:
        return (self - Lin.of(other)).is_zero()

    def is_zero(self) -> bool:
        return not self.terms and is_zero(self.const)

    # printing -------------------------------------------------------------
    def code(self, dim_code) -> str:
        """Triton code; `dim_code(dim)` prints a size (an int literal or a size argument)."""
        parts: list[tuple[bool, str]] = []
        for a, c in sorted(self.terms, key=lambda t: _atom_key(t[0])):
            neg = _negative(c)
            mag = norm(-sympy.sympify(c)) if neg else c
            atom = a.code(dim_code)
            if isinstance(a, (Div, ModIdx)) and not same_dim(mag, 1):
                atom = f"({atom})"
            parts.append((neg, atom if same_dim(mag, 1) else f"{dim_code(mag)} * {atom}"))
        if not is_zero(self.const) or not parts:
            neg = _negative(self.const)
            mag = norm(-sympy.sympify(self.const)) if neg else self.const
            parts.append((neg, dim_code(mag)))
        out = ("-" if parts[0][0] else "") + parts[0][1]
        for neg, p in parts[1:]:
            out += (" - " if neg else " + ") + p
        return out

    def __repr__(self) -> str:
        return self.code(lambda d: str(d) if isinstance(d, int) else f"({d})")


@_memo
def _negative(c: Dim) -> bool:
    if isinstance(c, int):
        return c < 0
    return sympy.sympify(c).could_extract_minus_sign()


Index = tuple[Lin, ...]


# ---------------------------------------------------------------- simplifying constructors


def floordiv(lin, d: Dim) -> Lin:
    """floor(lin / d) for d > 0, simplified."""
    lin = Lin.of(lin)
    d = norm(d)
    if same_dim(d, 1):
        return lin
    quot: dict = {}
    rest: dict = {}
    qconst = exact_div(lin.const, d)
    rconst: Dim = 0
    if qconst is None:
        qconst, rconst = 0, lin.const
    for a, c in lin.terms:
        q = exact_div(c, d)
        if q is None:
            rest[a] = c
        else:
            quot[a] = q
    q = Lin.build(quot, qconst)
    r = Lin.build(rest, rconst)
    if r.is_zero() or r.below(d):
        return q
    if len(r.terms) == 1:
        (a, c), = r.terms
        inner = Lin.build({}, r.const)
        k = exact_div(d, c)
        if k is not None and not same_dim(c, 1) and inner.below(c):
            return q + _div_atom(Lin.of(a), k)  # floor((c*a + small) / (c*k)) = floor(a / k)
        if same_dim(c, 1) and is_zero(r.const) and isinstance(a, Div):
            return q + _div_atom(a.lin, norm(a.d * d))  # floor(floor(L/a)/b) = floor(L/(ab))
        if same_dim(c, 1) and is_zero(r.const) and isinstance(a, ModIdx):
            k = exact_div(a.m, d)
            if k is not None:  # (L // a % (d*k)) // d = L // (a*d) % k
                return q + modidx(a.lin, norm(a.d * d), k)
    return q + _div_atom(r, d)


def _div_atom(lin: Lin, d: Dim) -> Lin:
    if same_dim(d, 1):
        return lin
    if lin.below(d):
        return Lin()
    return Lin.of(Div(lin, norm(d)))


def modidx(lin, d: Dim, m: Dim) -> Lin:
    """floor(lin / d) mod m, simplified (lin >= 0 on the lanes that matter)."""
    lin = Lin.of(lin)
    d, m = norm(d), norm(m)
    if same_dim(m, 1):
        return Lin()
    dm = norm(d * m)
    keep: dict = {}
    for a, c in lin.terms:
        if exact_div(c, dm) is None:
            keep[a] = c
    const = lin.const
    if exact_div(const, dm) is not None:
        const = 0
    r = Lin.build(keep, const)
    if r.below(dm):
        return floordiv(r, d)
    if len(r.terms) == 1:
        (a, c), = r.terms
        inner = Lin.build({}, r.const)
        k = exact_div(d, c)
        if k is not None and not same_dim(c, 1) and inner.below(c):
            return modidx(Lin.of(a), k, m)  # (c*a + small) // (c*k) % m = a // k % m
        k = exact_div(c, d)
        if k is not None and is_zero(r.const) and not (same_dim(k, 1) and same_dim(d, 1)):
            mk = exact_div(m, k)
            if mk is not None:  # (k*d*a // d) % (k*mk) = k * (a % mk)
                return modidx(Lin.of(a), 1, mk) * k
        if isinstance(a, Div) and same_dim(c, 1) and is_zero(r.const):
            return modidx(a.lin, norm(a.d * d), m)
        if isinstance(a, ModIdx) and same_dim(c, 1) and is_zero(r.const):
            k = exact_div(a.m, dm)
            if k is not None:  # (L // a % (d*m*k)) // d % m = L // (a*d) % m
                return modidx(a.lin, norm(a.d * d), m)
    return Lin.of(ModIdx(r, d, m))


def _recombine(terms: dict, const: Dim) -> Lin:
    """Fold k*ModIdx(L,d,m) + k*m*Div(L,d*m) -> k*Div(L,d), and the ModIdx-ModIdx analogue."""
    changed = True
    while changed:
        changed = False
        mods = [(a, c) for a, c in terms.items() if isinstance(a, ModIdx)]
        for a, c in mods:
            if a not in terms:
                continue
            want = norm(c * a.m)
            outer_d = norm(a.d * a.m)
            for b, cb in list(terms.items()):
                if b is a or not same_dim(cb, want) or b.__class__ not in (Div, ModIdx):
                    continue
                if b.lin != a.lin or not same_dim(b.d, outer_d):
                    continue
                del terms[a]
                del terms[b]
                if isinstance(b, Div):
                    merged = floordiv(a.lin, a.d) if not same_dim(a.d, 1) else a.lin
                else:
                    merged = modidx(a.lin, a.d, norm(a.m * b.m))
                for ma, mc in merged.terms:
                    terms[ma] = norm(terms.get(ma, 0) + mc * c)
                    if is_zero(terms[ma]):
                        del terms[ma]
                const = norm(const + merged.const * c)
                changed = True
                break
            if changed:
                break
    ordered = tuple(sorted(terms.items(), key=lambda t: _atom_key(t[0])))
    return Lin(ordered, const)


# ---------------------------------------------------------------- shapes


def strides(shape: Sequence[Dim]) -> list[Dim]:
    """Row-major strides of a contiguous tensor."""
    out: list[Dim] = []
    acc: Dim = 1
    for d in reversed(shape):
        out.append(acc)
        acc = norm(acc * d)
    return out[::-1]


def linearize(index: Index, shape: Sequence[Dim]) -> Lin:
    """The flat row-major offset of `index` in a contiguous tensor of `shape`."""
    assert len(index) == len(shape), (index, shape)
    total = Lin()
    for i, s in zip(index, strides(shape)):
        total = total + Lin.of(i) * s
    return total


def delinearize(flat, shape: Sequence[Dim]) -> Index:
    """The index of flat offset `flat` in a row-major tensor of `shape`."""
    flat = Lin.of(flat)
    out: list[Lin] = []
    st = strides(shape)
    for k, (size, s) in enumerate(zip(shape, st)):
        if same_dim(size, 1):
            out.append(Lin())
        elif k == 0 or all(same_dim(x, 1) for x in shape[:k]):
            out.append(floordiv(flat, s))
        else:
            out.append(modidx(flat, s, size))
    return tuple(out)


def reshape_index(index: Index, shape: Sequence[Dim], source: Sequence[Dim]) -> Index:
    """Index into `source` of element `index` of its row-major reshape to `shape`.

    Dims are matched in groups of equal products (kiln.ir.reshape.groups), so a reshape
    that only splits or merges some dims leaves the others' index expressions alone.
    """
    from kiln.ir.reshape import groups

    g = groups(list(source), list(shape))
    if g is None:
        return delinearize(linearize(index, shape), source)
    out: list[Lin | None] = [None] * len(source)
    for src_dims, dst_dims in g:
        flat = linearize(tuple(index[j] for j in dst_dims), [shape[j] for j in dst_dims])
        sub = delinearize(flat, [source[i] for i in src_dims])
        for i, v in zip(src_dims, sub):
            out[i] = v
    for i, v in enumerate(out):
        if v is None:  # a unit dim no group claimed
            out[i] = Lin()
    return tuple(out)


def broadcast_index(index: Index, shape: Sequence[Dim], operand: Sequence[Dim]) -> Index:
    """Index into an operand broadcast (numpy rules: align right) to `shape`. Export
    has decided each dim: 1 (broadcast) or the output's (guarded equal, though the two
    may be different symbols). A piecewise size (Max / Min: what slicing makes) that
    is neither provably declines: torch may know it is 1 where kiln cannot (MPT's ALiBi
    bias with a dynamic length was read at the query index once)."""
    lead = len(shape) - len(operand)
    assert lead >= 0, (shape, operand)
    for k, s in enumerate(operand):
        if _piecewise(s) and not same_dim(s, 1) and not same_dim(s, shape[lead + k]):
            raise CodegenUnsupported(f"an operand dim of size {s} broadcast to {shape[lead + k]}"
                                     " is neither 1 nor that size for every size")
    return tuple(Lin() if same_dim(s, 1) else index[lead + k] for k, s in enumerate(operand))


def _piecewise(d) -> bool:
    """Does a size hold a max / min (sympy's or torch's own)?"""
    return isinstance(d, sympy.Expr) and any(
        type(f).__name__ in ("Max", "Min") for f in sympy.preorder_traversal(d))


def index_vars(shape: Sequence[Dim], names: Sequence[str]) -> Index:
    """An index of `shape` whose dims are the kernel variables `names` (one per dim)."""
    return tuple(Lin() if same_dim(s, 1) else Lin.of(Var(n, s)) for n, s in zip(names, shape))


# ---------------------------------------------------------------- 64-bit indexing


@functools.lru_cache(maxsize=4096)
def _hi(expr, symbols_key) -> int | None:
    return upper_bound(expr, dict(symbols_key))


def may_exceed_int32(sizes: Sequence[Dim], symbols: dict[str, Bounds]) -> bool:
    """Might any of these element counts exceed 2**31 - 1 (an unbounded one might)?"""
    key = tuple(sorted(symbols.items()))
    for n in sizes:
        hi = n if isinstance(n, int) else _hi(n, key)
        if hi is None or hi > INT32_MAX - BLOCK_MARGIN:
            return True
    return False
