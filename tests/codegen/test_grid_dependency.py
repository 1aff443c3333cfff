"""Programmatic dependent launch: by default (KILN_PDL=0 turns it off), on sm_90 every
kiln kernel opens with the grid-dependency wait and is launched as a dependent; older
GPUs, ROCm and KILN_PDL=0 keep the ordinary launch. A chain of dependent kernels reads
its predecessors' results (gpu)."""

from types import SimpleNamespace

import pytest
import torch

from kiln.codegen.build import grid_dependency
from kiln.codegen.build.compiler import compile_binary
from kiln.codegen.build.launcher import independent
from kiln.codegen.build.spec import Config
from kiln.codegen.build.triton_kernel import BoundLaunch, TritonKernel
from kiln.runtime.program import follows_kernel
from kiln.target import get_target
from tests.codegen.test_triton_core import SOURCE, axpy_spec


def test_wait_opens_the_kernel_body_before_any_load():
    out = grid_dependency.with_grid_dependency(SOURCE, "axpy")
    body = out.split("def axpy(", 1)[1].splitlines()[1:]
    assert "_kiln_gdc_wait()" in body[0]
    assert out.count("tl.load") == SOURCE.count("tl.load")


def test_a_signature_over_several_lines_keeps_the_ordinary_launch():
    split = SOURCE.replace("def axpy(x_ptr, y_ptr,", "def axpy(x_ptr,\n         y_ptr,")
    assert grid_dependency.with_grid_dependency(split, "axpy") is None
    assert grid_dependency.with_grid_dependency(SOURCE, "missing") is None


@pytest.fixture
def pdl(monkeypatch):
    monkeypatch.setenv("KILN_PDL", "1")


def test_sm90_binary_waits_and_launches_as_dependent(pdl):
    b = compile_binary(axpy_spec(), Config.make(4, 1, XBLOCK=1024), get_target("cuda:sm_90"))
    assert b.metadata["launch_pdl"] is True
    assert "griddepcontrol.wait" in b.asm["ptx"]
    # no early release: the next kernel's blocks would sit on SMs this one needs
    assert "griddepcontrol.launch_dependents" not in b.asm["ptx"]


@pytest.mark.parametrize("target", ["cuda:sm_80", "rocm:gfx942"])
def test_targets_without_it_launch_the_ordinary_way(target, pdl):
    b = compile_binary(axpy_spec(), Config.make(4, 1, XBLOCK=1024), get_target(target))
    assert not b.metadata.get("launch_pdl")
    assert "griddepcontrol" not in b.asm.get("ptx", "")


def test_on_by_default_and_off_with_0(monkeypatch):
    monkeypatch.delenv("KILN_PDL", raising=False)
    assert grid_dependency.applies(get_target("cuda:sm_90"))
    monkeypatch.setenv("KILN_PDL", "0")
    assert not grid_dependency.applies(get_target("cuda:sm_90"))
    b = compile_binary(axpy_spec(), Config.make(4, 1, XBLOCK=1024), get_target("cuda:sm_90"))
    assert not b.metadata["launch_pdl"] and "griddepcontrol" not in b.asm["ptx"]


def _bound(launched=True, zeros=()):
    return BoundLaunch((lambda *a: None) if launched else None, (1, 1, 1), [], [],
                       list(zeros), [], plain=lambda *a: None)


def test_only_a_launch_right_after_a_kiln_kernel_is_dependent():
    torch_region = object()  # a TorchKernel's bound launch: torch ops in the stream
    steps = [_bound(), _bound(), torch_region, _bound(), _bound(launched=False), _bound(),
             _bound(zeros=["out"]), _bound()]
    follows_kernel([(b, [], []) for b in steps])
    got = [getattr(b, "dependent", None) for b in steps]
    # first of a call; after a kernel; -; after torch; empty grid; after an empty grid
    # (it only zeroed); zeroes its own output first (marked, launched plain); after it
    assert got == [False, True, None, False, True, False, True, True]


def test_zeroing_or_copying_an_input_launches_the_ordinary_way():
    calls = []
    b = BoundLaunch(lambda *a: calls.append("dependent"), (1, 1, 1), [None], [(0, "x", True, None)],
                    [], [], plain=lambda *a: calls.append("plain"))
    b.dependent = True
    b({"x": torch.zeros(4)}, 0)
    b({"x": torch.zeros(8)[::2]}, 0)  # not dense: copied by torch just before the launch
    z = torch.ones(3)
    b.zeros = [z]
    b({"x": torch.zeros(4)}, 0)
    assert calls == ["dependent", "plain", "plain"] and not z.any()


def test_an_ordinary_launch_of_a_dependent_kernel_turns_the_flag_off_in_a_copy():
    run = SimpleNamespace(launch_pdl=True)
    ck = SimpleNamespace(metadata=SimpleNamespace(launch_pdl=True), run=run,
                         _init_handles=lambda: None)
    plain = independent(ck)
    assert plain.run.launch_pdl is False and ck.run.launch_pdl is True
    other = SimpleNamespace(metadata=SimpleNamespace(launch_pdl=False), run=run)
    assert independent(other) is other


def test_the_ordinary_copy_of_a_kernel_whose_launcher_is_a_property():
    """Triton 3.5+ keeps the launcher in `_run` behind a read-only `run` property."""
    class Compiled:
        def __init__(self):
            self.metadata = SimpleNamespace(launch_pdl=True)
            self._run = SimpleNamespace(launch_pdl=True)

        def _init_handles(self):
            pass

        @property
        def run(self):
            return self._run

    ck = Compiled()
    plain = independent(ck)
    assert plain.run.launch_pdl is False and ck.run.launch_pdl is True


@pytest.mark.gpu
def test_chained_dependents_read_and_overwrite_their_predecessors_buffers(pdl):
    """Kernels launched back to back (and replayed in a CUDA graph), each reading the
    buffer its predecessor wrote and overwriting the one its predecessor read (ping-pong):
    with the launch as a dependent every kernel still sees finished results."""
    tgt = get_target("cuda")
    spec = axpy_spec()
    cfg = Config.make(4, 1, XBLOCK=1024)
    binary = compile_binary(spec, cfg, tgt)
    assert binary.metadata["launch_pdl"] == (tgt.arch >= 90)
    k = TritonKernel(None, spec, cfg, binary)
    n = 1 << 20
    x0, y = torch.randn(n, 3, device="cuda"), torch.randn(n, 3, device="cuda")
    ping, pong = torch.empty_like(x0), torch.empty_like(x0)

    launch = k.bind({"s0": n}, {}, x0.device, frozenset({"out"}))

    def chain():
        stream = torch.cuda.current_stream().cuda_stream  # the capture's, in a graph
        ping.copy_(x0)  # torch's copy: the first launch after it is an ordinary one
        for i in range(16):
            a, b = (ping, pong) if i % 2 == 0 else (pong, ping)
            launch.dependent = i > 0
            launch({"x": a, "y": y, "out": b}, stream)

    want = x0.clone()
    for _ in range(16):
        want = 2 * want + y
    chain()
    torch.testing.assert_close(ping, want, rtol=1e-5, atol=1e-5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    ping.fill_(float("nan"))
    pong.fill_(float("nan"))
    graph.replay()
    torch.testing.assert_close(ping, want, rtol=1e-5, atol=1e-5)
