"""Every fuzzer repro (tests/fuzz/repros/) on the GPU's real kernels: each class the
fuzzer found, compiled for cuda with tuning off (so every region runs its generated
kernel, never an extern that won a timing race), run at each of its sizes, against
eager on the CPU. The classes were found on the interpret target and on sm_90 compiles;
this checks the fixes hold where they matter."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

import kiln
from tests.fuzz.compare import verdict

REPROS = sorted((Path(__file__).parent / "repros").glob("repro_*.py"))


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _float64(model, state, args) -> list:
    """The model's outputs and buffers with its weights and float inputs in float64."""
    m64 = copy.deepcopy(model)
    m64.load_state_dict(state)
    m64 = m64.double()
    a64 = [a.double() if a.is_floating_point() else a for a in args]
    with torch.no_grad():
        return list(m64(*a64)) + [b for b in m64.buffers()]


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
        f64 = []
        for i, (o, r) in enumerate(zip(out, ref)):
            def reference(i=i, f64=f64, args=args):  # the fuzzer's float64 re-check
                f64[:] = f64 or _float64(model, state, args)
                return f64[i], []
            bad, detail = verdict(o.cpu(), r, reference)
            assert not bad, f"{path.stem} call {call} output {i}: {detail}"
