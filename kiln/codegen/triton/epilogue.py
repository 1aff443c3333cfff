"""How a matmul's product tile becomes the region's output: the epilogue.

The product is computed over [batch, M, N]; the region's output is the last op after
it, a contiguous value. When that output is the product itself or a row-major
reshape of it (a linear layer's [B*T, N] viewed back as [B, T, N]), its bytes are
the product's bytes in the same order, so the tile is stored at
`b * M * N + m * N + n`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.codegen.triton.params import Params
from kiln.ir.plan import DispatchPlan, Op, Ref, Region

TL_DTYPES = {torch.float32: "tl.float32", torch.float16: "tl.float16",
             torch.bfloat16: "tl.bfloat16"}

# Views after which a row-major value is the same bytes in the same order.
ROW_MAJOR_VIEWS = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
                   "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
                   "aten.squeeze.default", "aten.alias.default", "aten.clone.default"}


@dataclass
class Epilogue:
    output: str  # the region output (a plan value)
    dtype: torch.dtype
    ops: list[Op] = field(default_factory=list)  # the ops between product and output
    loads: int = 0  # extra tensors the epilogue reads (for the resource model)
    _ptr: str = "out_ptr"

    def bind(self, params: Params) -> None:
        self._ptr = params.tensor("out_ptr", self.output, self.dtype)

    def code(self, params: Params, acc: str, pid_b: str, rows: str, cols: str, ok: str,
             m, n) -> list[str]:
        mn = params.size(m * n)
        off = f"{pid_b} * {mn} + {rows} * {params.size(n)} + {cols}"
        return [f"tl.store({self._ptr} + {off}, {acc}.to({TL_DTYPES[self.dtype]}), mask={ok})"]


def _chain_to_output(region: Region, anchor: Op) -> list[Op] | None:
    """The ops from the anchor to the region's single output, if they form a chain."""
    if len(region.outputs) != 1:
        return None
    after = region.ops[region.ops.index(anchor) + 1:]
    chain, cur = [], anchor.name
    for op in after:
        if op.refs() != [cur]:
            return None
        chain.append(op)
        cur = op.name
    return chain if cur == region.outputs[0] else None


def analyse(region: Region, anchor: Op, plan: DispatchPlan) -> Epilogue | None:
    """The epilogue of `region` after `anchor`, or None when it cannot be generated."""
    chain = _chain_to_output(region, anchor)
    if chain is None:
        return None
    if all(op.target in ROW_MAJOR_VIEWS for op in chain) and all(
            isinstance(op.args[0], Ref) for op in chain):
        out = region.outputs[0]
        return Epilogue(out, plan.values[out].dtype, chain)
    return None
