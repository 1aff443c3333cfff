"""Shared test helpers: relative error, compile-and-compare."""

import torch
import torch.utils._pytree as pytree

import kiln


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    denom = ref.norm()
    if denom == 0:
        return out.norm().item()
    return ((out - ref).norm() / denom).item()


def assert_close_tree(out, ref, tol: float) -> None:
    outs, refs = pytree.tree_leaves(out), pytree.tree_leaves(ref)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.shape == r.shape, (o.shape, r.shape)
        assert o.dtype == r.dtype, (o.dtype, r.dtype)
        if o.dtype == torch.bool or not o.is_floating_point():
            assert torch.equal(o, r)
        else:
            assert rel_err(o, r) <= tol, rel_err(o, r)


def compile_and_compare(model, args, dynamic_shapes=None, tol=1e-5, calls=(), **kw):
    """Compile `model`, compare with eager on `args` and on every args tuple in `calls`."""
    exe = kiln.compile(model, args, dynamic_shapes=dynamic_shapes, **kw)
    for a in (args, *calls):
        assert_close_tree(exe(*a), model(*a), tol)
    return exe


def assert_lowp_close(out: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor,
                      tol: float = 1e-2, slack: float = 1.5) -> None:
    """A low-precision (fp16/bf16) result is right when it is within `tol` of eager's, or
    when its error against an fp32 reference is no worse than eager's own (x `slack`):
    both round at every op, in different orders, so neither is the truth."""
    err_vs_eager = rel_err(out, eager)
    if err_vs_eager <= tol:
        return
    err, eager_err = rel_err(out, exact), rel_err(eager, exact)
    assert err <= max(tol, slack * eager_err), (
        f"vs eager {err_vs_eager:.3g}; vs fp32 {err:.3g} (eager's own {eager_err:.3g})")
