import warnings

import torch
import torch.nn as nn

import kiln
from kiln.errors import KilnWarning
from kiln.graph.fold_conv_scale import fold_conv_scales
from tests.graph.util import assert_same_as_eager, graph_of, ops
from tests.helpers import rel_err


def _bn(c):
    bn = nn.BatchNorm2d(c)
    with torch.no_grad():
        bn.running_mean.normal_(0, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.normal_(1, 0.2)
        bn.bias.normal_(0, 0.2)
    return bn


class ConvBN(nn.Module):
    """A BatchNorm after a conv with a bias and after one without."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 4, 3, padding=1), _bn(4)
        self.c2, self.b2 = nn.Conv2d(4, 5, 1, bias=False), _bn(5)

    def forward(self, x):
        return self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))


def test_batchnorm_folds_into_both_convolutions():
    m = ConvBN().eval()
    x = torch.randn(2, 3, 6, 6)
    kg = graph_of(m, x)
    assert fold_conv_scales(kg) == 4  # a mul and an add each
    after = [o for o in ops(kg) if o != "aten.view.default"]
    conv2 = max(i for i, o in enumerate(after) if o == "aten.convolution.default")
    assert after[conv2 + 1:] == []  # nothing runs on the last conv's output
    assert_same_as_eager(kg, m, (x,), (torch.randn(1, 3, 5, 7),), tol=1e-5)


class NotPerChannel(nn.Module):
    """A scale over the width (not per channel), a conv read twice, a transposed conv."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.up = nn.ConvTranspose2d(3, 3, 2, stride=2)
        self.register_buffer("w_scale", torch.randn(6))
        self.register_buffer("c_scale", torch.randn(3, 1, 1))

    def forward(self, x):
        y = self.conv(x) * self.w_scale
        z = self.conv(y)
        return z * self.c_scale + z.sum(), self.up(y) * self.c_scale


def test_only_a_per_channel_constant_on_a_sole_reader_folds():
    m = NotPerChannel().eval()
    x = torch.randn(1, 3, 6, 6)
    kg = graph_of(m, x)
    assert fold_conv_scales(kg) == 0
    assert_same_as_eager(kg, m, (x,), tol=1e-5)


def test_cpu_target_folds_and_matches_eager_gpu_targets_keep_the_graph():
    m = ConvBN().eval()
    x = torch.randn(2, 3, 6, 6)
    exe = kiln.compile(m, (x,))
    names = [op.target for r in exe.plan.regions for op in r.ops]
    assert names.count("aten.convolution.default") == 2
    assert "aten.mul.Tensor" not in names and "aten.add.Tensor" not in names
    with torch.no_grad():
        assert rel_err(exe(x), m(x)) <= 1e-5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KilnWarning)
        kept = kiln.compile(m, (x,), target="interpret", compile_to="graph")
    assert "aten.mul.Tensor" in ops(kept)
