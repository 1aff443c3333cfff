"""Does a timed candidate compute what its region's torch form computes?

Why: a config can compile, fit the target and run fast, yet compute garbage: the
backend compiler can miscompile one config under register pressure (two num_warps=4
configs of the gated delta rule kernel gave a 0.7 relative error on an H100 while
their neighbours matched). Timing alone would crown such a config. So the tuner runs
the race's winner once more on the timing inputs and compares it with the extern
form; on a mismatch the next fastest, and so on.

Random inputs can be ill-conditioned for an op (a recurrence whose random gates
grow without bound), where even a correct kernel differs from the torch form. So a
mismatch is only a verdict when another candidate of the same kernel matches on
the same inputs: then the mismatching ones are recorded as `wrong` in the quarantine.
"""

from __future__ import annotations

import torch

# relative error (2-norm over the reference's finite elements) a correct kernel stays
# under: fp32 kernels may multiply in tf32; 16-bit outputs round at 2^-8
TOLERANCE = {torch.float32: 1e-2, torch.float64: 1e-6, torch.float16: 0.1,
             torch.bfloat16: 0.1}


def outputs(kernel, inputs: dict, like: dict, env: dict,
            inplace: dict[str, str | None] | None = None) -> dict[str, torch.Tensor]:
    """`kernel`'s outputs on `inputs`, in fresh buffers shaped as `like`.

    An output the region writes in place over a state (`inplace`, timing.inplace_inputs)
    stores only the rows it writes, as at run time, so its other rows must be the same
    in every run compared: it starts as a copy of the input it is written over, passed
    as that input, or, for a state the region does not read (a KV cache written from
    other values), as the same seeded random values each call. An empty buffer's other
    rows were garbage, and a correct candidate was judged wrong (or right) by the
    allocator's luck. `inputs` stay unchanged."""
    outs = {name: torch.empty_like(t) for name, t in like.items()}
    ins = dict(inputs)
    for out, state in (inplace or {}).items():
        if state is None:
            outs[out] = _seeded_like(outs[out])
            continue
        outs[out] = inputs[state].clone()
        ins[state] = outs[out]
    kernel.run(ins, outs, env)
    return outs


def _seeded_like(t: torch.Tensor) -> torch.Tensor:
    """The same random values (integers: zeros) shaped as `t`, on every call."""
    gen = torch.Generator(device=t.device)
    gen.manual_seed(20261201)
    if not t.dtype.is_floating_point:
        return torch.zeros_like(t)
    return torch.randn(t.shape, device=t.device, generator=gen).to(t.dtype)


def mismatch(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> str | None:
    """Why `got` is not `want` (floating outputs only), or None when they agree.

    Integer outputs are not compared: an argmax over random 16-bit values has ties
    that a correct kernel may break differently."""
    for name, w in want.items():
        tol = TOLERANCE.get(w.dtype)
        if tol is None:
            continue
        w, g = w.double(), got[name].double()
        finite = torch.isfinite(w)
        if not bool(finite.any()):
            continue
        w, g = w[finite], g[finite]
        if not bool(torch.isfinite(g).all()):
            return f"{name}: non-finite values where the torch form's are finite"
        err = float((g - w).norm() / w.norm().clamp_min(1e-30))
        if err > tol:
            return f"{name}: relative error {err:.2e} against the torch form (over {tol})"
    return None
