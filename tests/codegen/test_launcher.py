"""The GPU launch path, with Triton's launcher stubbed: direct (the launcher, function
handle and packed metadata bound once) when the compiled kernel has them and no launch
hook is set, else Triton's public path; a bound kernel passes kiln's own memory as
pointers and other tensors as tensors (inputs made dense)."""

import pytest
import torch

from kiln.codegen.build.compiler import compile_binary
from kiln.codegen.build.launcher import current_stream, direct_entry, hooks_set, launch_for
from kiln.codegen.build.spec import Config
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.target import get_target
from tests.codegen.test_triton_core import axpy_spec

knobs = pytest.importorskip("triton.knobs")  # Triton >= 3.4; older ones launch the public way


class FakeCompiled:
    """A CompiledKernel whose handles load on _init_handles and whose launches are recorded."""

    def __init__(self, complete: bool = True):
        self.complete = complete
        self.loads = 0
        self.launches = []

    def _init_handles(self):
        self.loads += 1
        if self.complete:
            self.function, self.packed_metadata, self.run = 77, (4, 1, 0), self._direct

    def _direct(self, gx, gy, gz, stream, function, packed, metadata, enter, leave, *args):
        self.launches.append(("direct", (gx, gy, gz), stream, function, packed,
                              (metadata, enter, leave), args))

    def __getitem__(self, grid):
        return lambda *args: self.launches.append(("public", tuple(grid), args))


class FakeBinary:
    resources = None

    def __init__(self, ck):
        self.ck = ck

    def kernel(self, spec, config):
        return self.ck


def test_direct_launch_binds_handle_and_metadata_once():
    ck = FakeCompiled()
    launch = launch_for(ck)
    launch(2, 1, 1, 123, ["a", 5])
    launch(3, 1, 1, 456, ["b"])
    assert ck.loads == 1
    assert ck.launches == [("direct", (2, 1, 1), 123, 77, (4, 1, 0), (None, None, None),
                            ("a", 5)),
                           ("direct", (3, 1, 1), 456, 77, (4, 1, 0), (None, None, None),
                            ("b",))]


def test_a_launch_hook_sends_launches_the_public_way(monkeypatch):
    ck = FakeCompiled()
    launch = launch_for(ck)  # bound before the hook is set: checked at each launch
    assert not hooks_set()
    with monkeypatch.context() as m:
        m.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
        assert hooks_set()
        launch(2, 1, 1, 123, ["a"])
    launch(2, 1, 1, 123, ["a"])
    assert [c[0] for c in ck.launches] == ["public", "direct"]
    assert ck.launches[0] == ("public", (2, 1, 1), ("a",))


def test_a_kernel_without_the_parts_launches_the_public_way():
    ck = FakeCompiled(complete=False)  # another Triton's CompiledKernel
    launch_for(ck)(4, 2, 1, 123, ["a"])
    assert ck.launches == [("public", (4, 2, 1), ("a",))]


def test_bound_kernel_passes_kiln_memory_as_pointers():
    ck = FakeCompiled()
    k = TritonKernel(None, axpy_spec(), Config.make(4, 1, XBLOCK=16), binary=FakeBinary(ck))
    x = torch.randn(7, 3)  # fixed: the arena's, passed as a pointer
    y = torch.randn(3, 7).t()  # not dense: copied before the launch
    out = torch.empty(7, 3)
    bound = k.bind({"s0": 7}, {"x": x}, torch.device("cpu"), frozenset({"out"}))
    bound({"x": torch.zeros(1), "y": y, "out": out}, 99)
    kind, grid, stream, function, _, _, args = ck.launches[-1]
    assert (kind, grid, stream, function) == ("direct", (2, 1, 1), 99, 77)  # cdiv(21, 16)
    assert args[0] == x.data_ptr()
    assert args[1].is_contiguous() and torch.equal(args[1], y)
    assert args[2] is out
    assert args[3:] == (21, 2.0, 16)  # n = 3 * s0, the constexpr, the tunable
    k.bind({"s0": 100}, {}, torch.device("cpu"), frozenset({"out"}))(
        {"x": x, "y": y, "out": out}, 0)
    assert ck.launches[-1][1] == (19, 1, 1) and ck.launches[-1][6][0] is x
    assert ck.loads == 1


def test_a_fixed_tensor_that_is_not_dense_is_looked_up_and_copied():
    ck = FakeCompiled()
    k = TritonKernel(None, axpy_spec(), Config.make(4, 1, XBLOCK=16), binary=FakeBinary(ck))
    x = torch.randn(3, 7).t()
    bound = k.bind({"s0": 7}, {"x": x}, torch.device("cpu"), frozenset({"out"}))
    bound({"x": x, "y": torch.randn(7, 3), "out": torch.empty(7, 3)}, 0)
    passed = ck.launches[-1][6][0]
    assert isinstance(passed, torch.Tensor) and passed.is_contiguous()
    assert torch.equal(passed, x)


def test_an_empty_grid_launches_nothing():
    ck = FakeCompiled()
    k = TritonKernel(None, axpy_spec(), Config.make(4, 1, XBLOCK=16), binary=FakeBinary(ck))
    k.bind({"s0": 0}, {}, torch.device("cpu"), frozenset({"out"}))(
        {"x": None, "y": None, "out": None}, 0)
    assert ck.launches == []


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_no_stream_off_gpus(device):
    assert current_stream(torch.device(device)) == 0


def test_launch_args_for_benchmarks_timing_their_own_launch():
    k = TritonKernel(None, axpy_spec(), Config.make(4, 1, XBLOCK=16), interpret=True)
    x, y, out = torch.randn(3, 7).t(), torch.randn(7, 3), torch.empty(7, 3)
    args, sizes = k.launch_args({"x": x, "y": y}, {"out": out}, {"s0": 7})
    assert sizes == {"n": 21}
    assert torch.equal(args[0], x) and args[0].is_contiguous()
    assert args[1] is y and args[2] is out and args[3:] == [21, 2.0, 16]


@pytest.mark.gpu
def test_this_triton_launches_the_direct_way_and_right(monkeypatch):
    spec, cfg = axpy_spec(), Config.make(4, 1, XBLOCK=1024)
    binary = compile_binary(spec, cfg, get_target("cuda"))
    assert direct_entry(binary.kernel(spec, cfg)) is not None  # the fast path, here
    k = TritonKernel(None, spec, cfg, binary)
    x, y = (torch.randn(1001, 3, device="cuda") for _ in range(2))
    arena_x = torch.empty_like(x).copy_(x)  # bound as a pointer
    for hooked in (False, True):
        if hooked:
            monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
        out = torch.full_like(x, float("nan"))
        k.bind({"s0": 1001}, {"x": arena_x}, x.device, frozenset({"out"}))(
            {"y": y, "out": out}, current_stream(x.device))
        torch.testing.assert_close(out, 2 * x + y)
