"""A decode batch's size switch (kiln/codegen/size_switch.py): each set of sizes bound to
its own kernel, both kept by save and load, a broken switch entry an ArtifactError.

The tuner makes switches only from GPU timings (tests/codegen/test_autotune.py fakes
them); here one is put into a compiled module by hand: the `x * 2 + 1` Triton kernel of
test_triton_kernels.py at the low end, torch ops above it.
"""

import json

import pytest
import torch

import kiln
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.codegen.size_switch import SizeSwitch
from kiln.codegen.torch_kernel import TorchKernel
from kiln.errors import ArtifactError
from tests.artifact.test_triton_kernels import Affine, affine_gen  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("affine_gen")


def _switched(target: str):
    """Affine compiled for `target` with a decode-like batch (1..4 rows), its region run
    by its Triton kernel up to 2 rows and by torch ops above; and the batch's symbol."""
    B = kiln.Dim("B", min=1, max=4)
    exe = kiln.compile(Affine(), (torch.randn(2, 3),), dynamic_shapes=({0: B},),
                       target=target, options={"tune": "none"})
    (region,) = exe.plan.regions
    triton = exe.program.kplan.kernels[region.name]
    assert isinstance(triton, TritonKernel)
    (symbol,) = exe.plan.symbols
    torch_ops = TorchKernel(region, exe.target.torch_device)
    exe.program.set_kernel(region.name, SizeSwitch(region, triton, torch_ops, {symbol: 2}))
    return exe, symbol


def _bound_kinds(switch: SizeSwitch) -> list[str]:
    """Records the kind of each kernel the switch binds, from now on."""
    kinds = []
    for side in (switch.low, switch.high):
        def bind(*args, _side=side, _bind=side.bind):
            kinds.append(_side.kind)
            return _bind(*args)
        side.bind = bind
    return kinds


def test_each_size_runs_its_own_kernel_and_a_saved_switch_keeps_both(tmp_path):
    exe, symbol = _switched("interpret")
    switch = exe.program.kplan.kernels["r0"]
    exe.save(tmp_path / "s.kiln")
    entry = json.loads((tmp_path / "s.kiln" / "manifest.json").read_text())["kernels"]["r0"]
    assert entry["kind"] == "switch" and entry["low_sizes"] == {symbol: 2}
    assert (entry["low"]["kind"], entry["high"]["kind"]) == ("triton", "torch")

    loaded = kiln.load(tmp_path / "s.kiln")
    again = loaded.program.kplan.kernels["r0"]
    assert isinstance(again, SizeSwitch) and again.low_sizes == {symbol: 2}
    assert isinstance(again.low, TritonKernel) and again.low.config == switch.low.config
    assert isinstance(again.high, TorchKernel)
    assert f"size switch: {symbol} <= 2 runs" in loaded.explain(kernels=True)
    for module in (exe, loaded):
        kinds = _bound_kinds(module.program.kplan.kernels["r0"])
        for rows, kind in ((1, "triton"), (2, "triton"), (3, "torch"), (4, "torch")):
            x = torch.randn(rows, 3)
            torch.testing.assert_close(module(x), x * 2.0 + 1.0, rtol=1e-6, atol=1e-6)
            assert kinds[-1] == kind, f"{rows} rows ran {kinds[-1]}"


def test_a_gpu_switch_saves_its_kernels_binary(tmp_path):
    exe, _ = _switched("cuda:sm_90")
    binary = exe.program.kplan.kernels["r0"].low.binary
    exe.save(tmp_path / "g.kiln")
    loaded = kiln.load(tmp_path / "g.kiln").program.kplan.kernels["r0"]
    assert loaded.low.binary.asm["cubin"] == binary.asm["cubin"]
    path = tmp_path / "g.kiln" / "manifest.json"
    m = json.loads(path.read_text())
    m["versions"]["triton"] = "2.0.0"  # the binary inside the switch is seen
    path.write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="compiled by Triton 2.0.0"):
        kiln.load(tmp_path / "g.kiln")


def _nested(entry):
    entry["low"] = dict(entry)


@pytest.mark.parametrize("edit, message", [
    (lambda e: e.update(low_sizes={"nope": 2}), "switches on 'nope', which is not one of"),
    (lambda e: e["low_sizes"].update({k: "2" for k in e["low_sizes"]}), "not an integer"),
    (lambda e: e.update(low_sizes={}), "has no low_sizes"),
    (lambda e: e.pop("high"), r"kernel entry \(its size switch's high side\) is not an obj"),
    (lambda e: e["low"].update(kind="quantum"),
     r"\(its size switch's low side\) of unknown kind 'quantum'"),
    (_nested, "has another switch as its low kernel"),
])
def test_a_broken_switch_entry_is_named(tmp_path, edit, message):
    _switched("interpret")[0].save(tmp_path / "s.kiln")
    path = tmp_path / "s.kiln" / "manifest.json"
    m = json.loads(path.read_text())
    edit(m["kernels"]["r0"])
    path.write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=message):
        kiln.load(tmp_path / "s.kiln")


@pytest.mark.gpu
def test_a_switch_runs_and_round_trips_on_the_gpu(tmp_path):
    exe, _ = _switched("cuda")
    exe.save(tmp_path / "c.kiln")
    loaded = kiln.load(tmp_path / "c.kiln")
    for module in (exe, loaded):
        kinds = _bound_kinds(module.program.kplan.kernels["r0"])
        for rows, kind in ((1, "triton"), (4, "torch")):
            x = torch.randn(rows, 3, device="cuda")
            torch.testing.assert_close(module(x), x * 2.0 + 1.0, rtol=1e-6, atol=1e-6)
            assert kinds[-1] == kind
