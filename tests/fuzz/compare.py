"""Is kiln's output wrong, or only differently rounded? Compare with eager, then with float64.

A difference from eager over the tolerance is not yet a mismatch: both round, in
different orders, and a discrete op (argmax, a comparison, a cast to int) turns a
last-bit difference into a different answer. So the reference is recomputed in
float64 (the same graph with every float dtype spelled float64) and, to measure how
ill-conditioned the graph is there, again on inputs perturbed by a relative `eps`.
kiln's output is a mismatch only when it is further from the float64 reference than
the tolerance, than 4x eager's own distance, and than 4x that conditioning.
"""

from __future__ import annotations

import torch

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def tolerance(dtype: torch.dtype) -> float:
    return TOL.get(dtype, 1e-5 if dtype.is_floating_point else 0.0)


def distance(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error over finite entries plus the share of entries whose NaN/inf
    pattern differs; for int and bool, the share of entries that differ."""
    if out.shape != ref.shape:
        return float("inf")
    if out.numel() == 0:
        return 0.0
    if not (out.is_floating_point() or ref.is_floating_point()):
        return (out != ref).double().mean().item()
    a, b = out.double(), ref.double()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    both = fa & fb
    pattern = (fa != fb) | (~fa & ~fb & ~((a == b) | (a.isnan() & b.isnan())))
    frac = pattern.double().mean().item()
    if not both.any():
        return frac
    da, db = a[both], b[both]
    denom = db.norm().item()
    num = (da - db).norm().item()
    rel = num if denom == 0 else num / denom
    return rel + frac


def perturbed(args: tuple, eps: float, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    out = []
    for a in args:
        if a.is_floating_point():
            a = a * (1 + eps * torch.randn(a.shape, generator=g, dtype=a.dtype))
        out.append(a)
    return tuple(out)


def verdict(out: torch.Tensor, eager: torch.Tensor, reference) -> tuple[bool, str]:
    """(is_mismatch, detail). `reference()` returns (f64_value, [perturbed f64 values])."""
    if out.dtype != eager.dtype:
        return True, f"dtype {out.dtype} vs eager {eager.dtype}"
    if out.shape != eager.shape:
        return True, f"shape {tuple(out.shape)} vs eager {tuple(eager.shape)}"
    tol = tolerance(eager.dtype)
    e = distance(out, eager)
    if e <= tol:
        return False, ""
    ref, nearby = reference()
    e_kiln = distance(out, ref)
    e_eager = distance(eager, ref)
    cond = max((distance(p, ref) for p in nearby), default=0.0)
    bad = e_kiln > max(tol, 4 * e_eager, 4 * cond)
    return bad, (f"vs eager {e:.3g}; vs float64 {e_kiln:.3g} (eager's {e_eager:.3g}, "
                 f"conditioning {cond:.3g}, tol {tol:g})")
