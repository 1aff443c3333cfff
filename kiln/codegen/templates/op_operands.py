"""The shape and dtype of a kiln op's operand inside its region: a region input is a
value of the plan; anything else is one of the region's own ops (a fused prologue).
Every template that reads an operand's shape or dtype off the plan does it here."""

from __future__ import annotations

import torch

from kiln.ir.plan import DispatchPlan, Region


def operand_shape(region: Region, plan: DispatchPlan, name: str) -> tuple:
    if name in region.inputs:
        return tuple(plan.values[name].shape)
    return tuple(region.op(name).shape)


def operand_dtype(region: Region, plan: DispatchPlan, name: str) -> torch.dtype:
    if name in region.inputs:
        return plan.values[name].dtype
    return region.op(name).dtype
