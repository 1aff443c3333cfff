"""The row kernel's forms (kiln/codegen/row_forms.py) vs eager: rows longer than
16384 held whole, fp32 sums and means split across programs (partial sums added
atomically into the zeroed output), and the looped form's online softmax at its edge
values. In Triton's interpreter, at configs small enough to give every tail a turn."""

import pytest
import torch
import torch.nn.functional as F

from kiln.codegen.build.triton_kernel import TritonKernel
from tests.codegen.gen_helpers import assert_matches, compile_interpret, triton_kernels
from tests.codegen.test_reduction_kernels import LARGE, _with_config

UNBOUNDED = torch.export.Dim("N", min=2)


def _forms(exe) -> list[str]:
    return [k.spec.meta["form"] for k in triton_kernels(exe) if k.spec.template == "reduction"]


class Wide(torch.nn.Module):
    def forward(self, x):
        return (torch.softmax(x, -1), torch.log_softmax(x, -1), x.argmax(-1),
                F.layer_norm(x, (x.shape[-1],)), torch.logsumexp(x, -1), x.amax(-1))


def test_rows_past_16k_are_held_whole():
    x = torch.randn(3, 20000)
    exe = compile_interpret(Wide(), (x,))
    reds = [k for k in triton_kernels(exe) if k.spec.template == "reduction"]
    assert reds and all(k.spec.meta["form"] == "persistent" and k.config["RBLOCK"] == 32768
                        for k in reds), [(k.spec.name, k.spec.meta, str(k.config)) for k in reds]
    x = torch.randn(3, 20000) * 4
    x[1, 12345] = 40.0  # one large logit: its argmax and a peaked softmax
    assert_matches(exe(x), Wide()(x), 1e-5)


class Sums(torch.nn.Module):
    """fp32 sums and means over every kind of axis set: strided, middle, all, innermost."""

    def forward(self, x, y, z):
        h = z.float()  # a low-precision input summed in fp32 (the convert fuses)
        return x.sum(0), x.mean(0, keepdim=True), y.sum(1), y.mean((0, 1)), h.sum(), h.mean(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_of_sums_split_across_programs(dtype):
    def inputs(n):
        return (torch.randn(n, 9), torch.randn(2, n, 5), torch.randn(3, n).to(dtype))

    args = inputs(40)
    exe = compile_interpret(Sums(), args, ({0: LARGE}, {1: LARGE}, {1: LARGE}))
    assert _forms(exe) and set(_forms(exe)) == {"split"}, _forms(exe)
    assert all(k.spec.zero_outputs == k.region.outputs for k in triton_kernels(exe)
               if k.spec.template == "reduction")
    _with_config(exe, XBLOCK=4, RBLOCK=8)  # 301 rows: ten programs a column, a short last
    for n in (301, 17):  # a second run must not add into the first one's results
        args = inputs(n)
        assert_matches(exe(*args), Sums()(*args), 1e-5)


def test_split_with_unbounded_rows():
    class M(torch.nn.Module):
        def forward(self, x):
            return x.sum(0), x.mean(-1)

    exe = compile_interpret(M(), (torch.randn(6, 5),), ({0: UNBOUNDED},))
    assert "split" in _forms(exe)
    _with_config(exe, XBLOCK=2, RBLOCK=4)
    x = torch.randn(123, 5)
    assert_matches(exe(x), M()(x), 1e-5)


class NotSplit(torch.nn.Module):
    """Column reductions the split form must leave alone: a low-precision result,
    extremes, integer counts, and a sum sharing its region with other outputs."""

    def forward(self, x):
        h = x.to(torch.bfloat16)
        return h.mean(0), x.amax(0), x.argmax(0), (x > 0).sum(0), torch.var(x, 0)


def test_column_reductions_that_are_not_split():
    x = torch.randn(80, 6)
    exe = compile_interpret(NotSplit(), (x,), ({0: LARGE},))
    assert "split" not in _forms(exe), _forms(exe)
    _with_config(exe, XBLOCK=2, RBLOCK=8)
    x = torch.randn(97, 6)
    out, ref = exe(x), NotSplit()(x)
    assert_matches(out[1:], ref[1:], 1e-5)
    assert_matches(out[0], ref[0], 1e-2)


class Softmaxes(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x, -1), torch.log_softmax(x, -1), torch.logsumexp(x, -1)


def test_looped_online_softmax_edge_values():
    x = torch.randn(6, 40)
    exe = compile_interpret(Softmaxes(), (x,), ({1: LARGE},))
    assert "persistent" not in _forms(exe)
    softmax = next(k for k in triton_kernels(exe) if k.spec.name.endswith("_softmax"))
    assert "for rstep in tl.range" in softmax.spec.source  # the second sweep runs backwards
    _with_config(exe, XBLOCK=2, RBLOCK=8)
    x = torch.randn(6, 45) * 5
    x[0, 3] = float("nan")  # a NaN row
    x[1, :] = -float("inf")  # all -inf
    x[2, 40] = float("inf")  # +inf after finite values, in the last (short) chunk
    x[3, 0] = float("inf")  # +inf first: later finite values must not unset it
    x[4, 10:] = -float("inf")  # -inf tail after a finite head
    x[5, 44] = 60.0  # a new maximum in the last chunk rescales the sum
    assert_matches(exe(x), Softmaxes()(x), 1e-5)


def test_zeroed_outputs_survive_a_saved_spec():
    x = torch.randn(200, 3)

    class M(torch.nn.Module):
        def forward(self, x):
            return x.sum(0)

    exe = compile_interpret(M(), (x,), ({0: LARGE},))
    k = next(k for k in triton_kernels(exe) if k.spec.template == "reduction")
    again = type(k.spec).from_json(k.spec.to_json())
    assert again.zero_outputs == k.spec.zero_outputs == k.region.outputs
    out = {o: torch.full((3,), 7.0) for o in k.region.outputs}  # stale values
    TritonKernel(k.region, again, k.config, interpret=True).run(
        {k.region.inputs[0]: x}, out, exe.program.bind([x]))
    assert_matches(list(out.values())[0], x.sum(0), 1e-5)


def _gpu_cases():
    """(name, module, example) for the forms' GPU code: long rows held whole, the split
    form's atomics, and a looped row too long to hold."""
    def fn(f):
        class M(torch.nn.Module):
            def forward(self, x):
                return f(x)
        return M()

    return [
        ("softmax 32000 f32", fn(lambda x: torch.softmax(x, -1)), torch.randn(4, 32000)),
        ("softmax 32000 bf16", fn(lambda x: torch.softmax(x, -1)),
         torch.randn(4, 32000, dtype=torch.bfloat16)),
        ("argmax 32000", fn(lambda x: x.argmax(-1)), torch.randn(4, 32000)),
        ("column sum", fn(lambda x: x.sum(0)), torch.randn(128, 8192)),
        ("softmax 128256 bf16", fn(lambda x: torch.softmax(x, -1)),
         torch.randn(2, 128256, dtype=torch.bfloat16)),
    ]


@pytest.fixture(scope="module")
def gpu_plans():
    import kiln

    return [(name, kiln.compile(m, (x,), compile_to="dispatch")) for name, m, x in _gpu_cases()]


@pytest.mark.parametrize("target", ["cuda:sm_90", "cuda:sm_80", "rocm:gfx942"])
def test_forms_compile_within_target_limits(gpu_plans, target):
    """Every form's default config compiles for the target without spilling; on sm_90
    the loads are 16-byte vectors (the looped form's go through cp.async, chunks ahead)
    and the split form's adds are fire-and-forget REDs."""
    from kiln.codegen.build.compiler import compile_binary
    from kiln.codegen.build.resources import violations
    from kiln.codegen.select_kernels import TEMPLATES
    from kiln.ir.plan import RegionKind
    from kiln.target import TARGETS

    tgt = TARGETS[target]
    forms = set()
    for name, plan in gpu_plans:
        for region in plan.regions:
            if region.kind != RegionKind.REDUCTION:
                continue
            spec = TEMPLATES[region.kind](region, plan, tgt)
            assert spec is not None, (name, region.notes)
            forms.add(spec.meta["form"])
            b = compile_binary(spec, spec.default, tgt)
            assert not violations(b.resources, tgt) and b.resources.spills in (None, 0), \
                (name, str(spec.default), b.resources)
            if target == "cuda:sm_90":
                sass = _sass(b.asm["cubin"])
                vector = "LDGSTS.E.BYPASS.128" if spec.meta["form"] == "looped" else "LDG.E.128"
                assert vector in sass, (name, str(spec.default))
                if spec.meta["form"] == "split":
                    assert "REDG.E.ADD.F32" in sass, name
    assert forms == {"persistent", "split", "looped"}


def _sass(cubin: bytes) -> str:
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "--dump-sass", f.name], capture_output=True,
                              text=True, timeout=60).stdout


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forms_on_gpu(dtype):
    """Each form at its default config on the GPU: a 32000-wide row held whole (1024
    threads), a 128256-wide one looped, and split sums whose atomics really race."""
    import kiln

    tol = 1e-5 if dtype == torch.float32 else 1e-2
    dims = [torch.export.Dim(n, min=2, max=1 << 20) for n in ("R", "S", "C")]

    def check(model, args, dyn=None):
        exe = kiln.compile(model, args, dynamic_shapes=dyn, target="cuda",
                           options={"tune": "none"})
        assert all(isinstance(k, TritonKernel) for k in exe.program.kplan.kernels.values())
        return exe

    x = (torch.randn(64, 32000) * 3).to(dtype).cuda()
    exe = check(Wide(), (x,))
    assert "persistent" in _forms(exe)
    assert_matches(exe(x), Wide()(x), tol)
    x = (torch.randn(5, 128256) * 3).to(dtype).cuda()
    exe = check(Softmaxes(), (x,))
    assert_matches(exe(x), Softmaxes()(x), tol)
    def sums_args(n):  # positive: sums of 10^5 terms that do not cancel, so fp32 orders
        return (torch.rand(n, 700).cuda(), torch.rand(4, n, 96).cuda(),  # agree to 1e-5
                torch.rand(6, n * 10).to(dtype).cuda())

    exe = check(Sums(), sums_args(3000), ({0: dims[0]}, {1: dims[1]}, {1: dims[2]}))
    assert set(_forms(exe)) == {"split"}
    for n in (4099, 777):  # the second call must not add into the first one's results
        args = sums_args(n)
        assert_matches(exe(*args), Sums()(*args), 1e-5)
