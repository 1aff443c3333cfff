# ruff: noqa
"""kiln fuzzer repro (seed 100334): mismatch|interpret|values|arange_add

    call 0 at size None, output 0: vs eager 2.02; vs float64 2.02 (eager's 0, conditioning 0, tol 0.02)

Run from the kiln checkout: PYTHONPATH=. python repro_seed100334_mismatch.py
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln

class Fuzzed(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(100334)
    def forward(self, x3):
        v14 = x3 + torch.arange(x3.shape[0], device=x3.device).reshape((-1, 1, 1)).to(x3.dtype)
        return (v14,)


INPUTS = [((3, 1, 1), 'bf16', 8)]  # (shape, dtype, high); "D" is the dynamic dim
DYN = None  # (min, max, example size, other call sizes) or None
TARGET = 'interpret'
OPTIONS = None


def make_args(size, call):
    g = torch.Generator().manual_seed(100334 * 1009 + call * 7919 + (size or 0))
    out = []
    for shape, dt, high in INPUTS:
        shape = tuple(size if d == "D" else d for d in shape)
        if dt in ("f32", "f16", "bf16"):
            dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dt]
            out.append(torch.randn(shape, generator=g).to(dtype))
        elif dt == "bool":
            out.append(torch.rand(shape, generator=g) < 0.5)
        else:
            out.append(torch.randint(0, max(high, 1), shape, generator=g))
    return tuple(out)


def rel_err(out, ref):
    if out.dtype != ref.dtype or out.shape != ref.shape:
        return float("inf")
    if not out.is_floating_point():
        return (out != ref).double().mean().item()
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def main():
    model = Fuzzed().eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    dyn = None
    sizes = [None]
    if DYN is not None:
        d = kiln.Dim("D", min=DYN[0], max=DYN[1])
        dyn = tuple({i: d for i, s in enumerate(shape) if s == "D"} or None
                    for shape, _, _ in INPUTS)
        sizes = [DYN[2], *DYN[3]]
    exe = kiln.compile(model, make_args(sizes[0], 0), dynamic_shapes=dyn, target=TARGET,
                       options=OPTIONS)
    if TARGET.startswith(("cuda", "rocm")):
        for r in exe.plan.regions:
            print(r.name, r.kind, r.notes)
        return
    for call, size in enumerate(sizes):
        args = make_args(size, call)
        model.load_state_dict(state)
        with torch.no_grad():
            ref = list(model(*args)) + [b.clone() for b in model.buffers()]
        for name, t in exe.state.items():
            if name in state:
                t.copy_(state[name])
        out = list(exe(*args)) + [exe.state[n] for n, _ in model.named_buffers()]
        for i, (o, r) in enumerate(zip(out, ref)):
            print(f"call {call} (size {size}) output {i} {o.dtype} {tuple(o.shape)}: "
                  f"rel err vs eager {rel_err(o, r):.3g}")


if __name__ == "__main__":
    main()
