"""Every device a plan needs is declared, checked when the plan is made (failure 4)."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.errors import AffinityError, ArgumentError, DeviceError
from tests.parallel.test_tensor_parallel import _llama70b


class PinsEightDevices(torch.nn.Module):
    """Model code that pins tensors to cuda:0..cuda:7 (folded away as constants later)."""

    def __init__(self):
        super().__init__()
        self.lins = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(8))

    def forward(self, x):
        for i, lin in enumerate(self.lins):
            x = lin(x) + torch.ones(8, device=f"cuda:{i}").to("cpu")
        return x


def test_devices_the_model_pins_must_be_declared_even_for_one_device():
    with pytest.raises(DeviceError) as info:
        kiln.compile(PinsEightDevices(), (torch.randn(2, 8),))
    text = str(info.value)
    assert "the plan needs devices [1, 2, 3, 4, 5, 6, 7]" in text
    assert "declared: [0]" in text
    for d in range(1, 8):
        assert f"device {d}: named by the model's code" in text
    assert "test_device_checks.py" in text and 'device=f"cuda:{i}"' in text  # source lines
    assert "devices=8" in text and "device_map" in text  # what to do


@pytest.mark.parametrize("kw", [{"devices": 8}, {"devices": list(range(8))},
                                {"device_map": {i: 0 for i in range(8)}}])
def test_declared_or_mapped_devices_pass(kw):
    """The plan is made (running it needs the eight GPUs the model's code names)."""
    kg = kiln.compile(PinsEightDevices(), (torch.randn(2, 8),), compile_to="parallel", **kw)
    assert all(n.meta["device"] == 0 for n in kg.graph.nodes)


def test_llama2_70b_tp8_plan_with_one_device_declared():
    """The seed case whole: 80 layers, on the meta device, compile-only for sm_90."""
    model, args = _llama70b(layers=80)
    with pytest.raises(DeviceError) as info:
        kiln.compile(model, args, target="cuda:sm_90", parallel={"tp": 8, "rank": 0},
                     devices=1)
    text = str(info.value)
    assert "the plan needs devices [1, 2, 3, 4, 5, 6, 7]" in text
    assert "ranks of the tp=8 x pp=1 plan" in text
    assert "all_reduce" in text and "llama.py" in text  # the ops, with source lines
    assert "devices=8" in text and "device_map" in text  # how to declare or map them


@pytest.mark.parametrize("devices", [0, [], [-1], "cuda", True])
def test_bad_devices_argument(devices):
    with pytest.raises(ArgumentError, match="devices="):
        kiln.compile(torch.nn.Linear(4, 4), (torch.randn(2, 4),), devices=devices)


class MixesDevices(torch.nn.Module):
    def forward(self, x):
        a = torch.ones(4, device="cuda:0")
        b = torch.ones(4, device="cuda:1")
        return x + (a + b).to("cpu")  # one op reading tensors pinned to two devices


def test_contradictory_pins_in_the_models_code_are_an_affinity_error():
    with pytest.raises(AffinityError) as info:
        kiln.compile(MixesDevices(), (torch.randn(4),))
    text = str(info.value)
    assert "pinned to cuda:0 and cuda:1" in text
    assert "test_device_checks.py" in text and "(a + b)" in text  # the user's line
