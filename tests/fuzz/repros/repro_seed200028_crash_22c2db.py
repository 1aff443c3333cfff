# ruff: noqa
"""kiln fuzzer repro (seed 200028): crash|cpu|compile|VerifierError|IR verification failed after pass dispatch/form_regions: plan output %slice_N is never produced

    VerifierError: IR verification failed after pass dispatch/form_regions: plan output %slice_1 is never produced where: pass dispatch/form_regions hint: this is a kiln bug; rerun with KILN_DUMP_IR=<dir> and report the dumps. File "/work/wt-fuzz/tests/fuzz/oracle.py", line 186, in _check_target exe = _compile(cfg, model, example, spec, target) ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^ File "/work/wt-fuzz/tests/fuzz/oracle.py", line 88, in _compile return fn(model, args, dynamic_shapes=dynamic_shapes(spec), target=target, ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^ File "/work/wt-fuzz/kiln/api.py", line 91, in compile result = build_pipeline(dump_ir).run(src, ctx, compile_to=compile_to) ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^ File "/work/wt-fuzz/kiln/pipeline.py", line 92, in run self._check(ir, stage, p) File "/work/wt-fuzz/kiln/pipeline.py", line 104, in _check raise VerifierError( kiln.errors.VerifierError: IR verification failed after pass dispatch/form_regions: plan output %slice_1 is never produced where: pass dispatch/form_regions hint: this is a kiln bug; rerun with KILN_DUMP_IR=<dir> and report the dumps.

Run from the kiln checkout: PYTHONPATH=. python repro_seed200028_crash_22c2db.py
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln

class Fuzzed(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(200028)
    def forward(self, v1):
        v4 = v1.chunk(4, 0)[3]
        v8 = v4.reshape(4, v4.shape[1], 2, 4)
        return (v4, v8,)


INPUTS = [((16, 6, 8), 'bool', 8)]  # (shape, dtype, high); "D" is the dynamic dim
DYN = None  # (min, max, example size, other call sizes) or None
TARGET = 'cpu'
OPTIONS = None


def make_args(size, call):
    g = torch.Generator().manual_seed(200028 * 1009 + call * 7919 + (size or 0))
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
