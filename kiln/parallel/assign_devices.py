"""Device assignment: which device each op runs on, checked against the device table.

For a single-device plan every op runs on device 0. A graph that already names
devices (tensors pinned elsewhere by the model) must only use declared devices: the
error names the op and the devices it needs, so it surfaces when the plan is made,
not at run time (DESIGN.md failure 4).
"""

from __future__ import annotations

import torch

from kiln.errors import DeviceError
from kiln.ir.graph import KilnGraph, where
from kiln.pipeline import as_pass


def _devices_named(kg: KilnGraph) -> dict[int, list[str]]:
    used: dict[int, list[str]] = {}
    for node in kg.graph.nodes:
        dev = node.kwargs.get("device") if node.op == "call_function" else None
        if isinstance(dev, torch.device) and dev.type != "cpu" and dev.index is not None:
            used.setdefault(dev.index, []).append(node.name)
    return used


@as_pass(establishes=("devices-assigned",))
def assign_devices(kg: KilnGraph, ctx) -> KilnGraph:
    declared = list(ctx.options.get("devices") or [0])
    for index, nodes in _devices_named(kg).items():
        if len(declared) == 1:
            continue  # a single-device plan places every op on its one device
        if index not in declared:
            first = next(n for n in kg.graph.nodes if n.name == nodes[0])
            raise DeviceError(
                f"ops {', '.join(nodes[:5])} need device {index}, but the plan declares only "
                f"devices {declared}",
                where=where(first),
                hint=f"declare device {index} (devices={sorted({*declared, index})}) or map it "
                "onto a declared device",
            )
    for node in kg.graph.nodes:
        node.meta["device"] = declared[0]
    return kg
