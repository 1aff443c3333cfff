"""Every fuzzer repro (tests/fuzz/repros/) on the GPU's real kernels: each class the
fuzzer found, compiled for cuda with tuning off (so every region runs its generated
kernel, never an extern that won a timing race), run at each of its sizes, against
eager on the CPU. The classes were found on the interpret target and on sm_90 compiles;
this checks the fixes hold where they matter."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import kiln

REPROS = sorted((Path(__file__).parent / "repros").glob("repro_*.py"))
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return False
    if not ref.is_floating_point():
        return torch.equal(out, ref)
    out, ref = out.double(), ref.double()
    if not torch.equal(torch.isfinite(out), torch.isfinite(ref)):
        return False
    fin = torch.isfinite(ref)
    err = ((out[fin] - ref[fin]).norm() / ref[fin].norm().clamp_min(1e-30)).item()
    return err <= TOLERANCE[ref.dtype if ref.dtype in TOLERANCE else torch.float32] * 10


def test_every_repro_is_found():
    assert len(REPROS) >= 20
    for path in REPROS:
        m = _load(path)
        assert hasattr(m, "Fuzzed") and hasattr(m, "make_args"), path.name


@pytest.mark.gpu
@pytest.mark.parametrize("path", REPROS, ids=[p.stem for p in REPROS])
def test_repro_on_cuda_kernels_matches_eager(path):
    m = _load(path)
    model = m.Fuzzed().eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    sizes, dyn = [None], None
    if m.DYN is not None:
        d = kiln.Dim("D", min=m.DYN[0], max=m.DYN[1])
        dyn = tuple({i: d for i, s in enumerate(shape) if s == "D"} or None
                    for shape, _, _ in m.INPUTS)
        sizes = [m.DYN[2], *m.DYN[3]]
    gpu_model = m.Fuzzed().eval().cuda()
    gpu_model.load_state_dict({k: v.cuda() for k, v in state.items()})
    example = tuple(a.cuda() for a in m.make_args(sizes[0], 0))
    exe = kiln.compile(gpu_model, example, dynamic_shapes=dyn, target="cuda",
                       options={"tune": "none"})
    for call, size in enumerate(sizes):
        args = m.make_args(size, call)
        model.load_state_dict(state)
        with torch.no_grad():
            ref = list(model(*args)) + [b.clone() for b in model.buffers()]
        for name, t in exe.state.items():
            if name in state:
                t.copy_(state[name])
        out = list(exe(*(a.cuda() for a in args)))
        out += [exe.state[n] for n, _ in model.named_buffers()]
        for i, (o, r) in enumerate(zip(out, ref)):
            assert _close(o.cpu(), r), f"{path.stem} call {call} output {i}"
