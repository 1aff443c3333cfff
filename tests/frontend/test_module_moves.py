"""A forward that converts its own module: a no-op `.to` compiles (SwitchTransformers'
and NLLB-MoE's routers cast their classifier to the router dtype in forward, which
torch.export could not trace), a real conversion is a clear ExportError."""

import pytest
import torch

import kiln
from kiln.errors import ExportError


class Router(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.classifier = torch.nn.Linear(4, 3)
        self.dtype = dtype

    def forward(self, x):
        self.classifier = self.classifier.to(self.dtype)
        return self.classifier(x.to(self.dtype)).softmax(-1)


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_a_move_to_what_the_module_has_compiles(target):
    model = Router(torch.float32).eval()
    exe = kiln.compile(model, (torch.randn(2, 4),), target=target)
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(exe(x), model(x))
    assert torch.nn.Module.to.__qualname__ == "Module.to"  # export's patch is undone


def test_a_real_conversion_in_forward_says_to_convert_first():
    with pytest.raises(ExportError, match="converts one of its own modules") as e:
        kiln.compile(Router(torch.float64), (torch.randn(2, 4),))
    assert "test_module_moves.py" in e.value.where and "self.classifier.to" in e.value.where
    assert "before compiling" in e.value.hint
