"""Tensor parallelism keeps the narrow version (kiln/dispatch/narrow_rows.py): each rank
compiles its part again for one row, every rank picks the same version for a call (the
collectives stay matched), and one row decodes by GEMVs under tp=2 as on one device."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import rel_err
from tests.parallel.spmd import run_spmd

pytestmark = pytest.mark.filterwarnings("ignore")


def _rank(rank, world):
    import kiln
    from tests.runtime.test_narrow_version import Block

    torch.manual_seed(0)
    model = Block().half()
    batch = kiln.Dim("batch", min=1, max=4)
    exe = kiln.compile(model, (torch.randn(2, 64, dtype=torch.float16),),
                       dynamic_shapes=({0: batch},), target="interpret",
                       parallel={"tp": world})
    narrow = exe.program.narrow
    torch.manual_seed(1)
    xs = [torch.randn(rows, 64, dtype=torch.float16) for rows in (1, 3)]
    outs = [exe(x).float() for x in xs]
    ref = Block()
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with torch.no_grad():
        want = [ref(x.float()) for x in xs]
    collectives = [r.anchor().target for r in exe.plan.regions if r.kind.value == "extern"]
    return (narrow is not None and narrow.hi, [rel_err(o, w) for o, w in zip(outs, want)],
            collectives)


def test_tp2_ranks_decode_one_row_by_their_narrow_versions():
    for hi, errs, collectives in run_spmd(_rank, 2, timeout=200):
        assert hi == 1
        assert any(".all_" in c for c in collectives)  # the plan is cut
        assert max(errs) <= 1e-2, errs
