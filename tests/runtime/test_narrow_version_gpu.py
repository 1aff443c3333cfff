"""The narrow version on a GPU (runtime/program.py): one row runs its GEMVs, more rows the
tiled plan, through CUDA graphs too (a graph per size, each captured from the version
that size runs)."""

import pytest
import torch

import kiln
from tests.helpers import rel_err
from tests.runtime.test_narrow_version import Block

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_each_size_runs_its_version_through_cuda_graphs(dtype):
    torch.manual_seed(0)
    model = Block(256).to("cuda", dtype)
    ref = Block(256).cuda()
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    batch = kiln.Dim("batch", min=1, max=8)
    exe = kiln.compile(model, (torch.randn(2, 256, device="cuda", dtype=dtype),),
                       dynamic_shapes=({0: batch},), target="cuda")
    assert exe.program.narrow is not None
    plain = [exe(x) for x in (torch.randn(r, 256, device="cuda", dtype=dtype) for r in (1, 5))]
    exe.cuda_graphs()
    for rows in (1, 5, 1):
        x = torch.randn(rows, 256, device="cuda", dtype=dtype)
        assert rel_err(exe(x).float(), ref(x.float())) <= 2e-2, rows
    assert len(exe._graphs.graphs) == 2
    assert all(p.shape[0] in (1, 5) for p in plain)
