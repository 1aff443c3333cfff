"""Device checks: every device the plan needs is declared, found when the plan is made.

A plan needs its logical devices, one per rank of `parallel=` (tp x pp), and every
device the model's own code names (`.to("cuda:3")`, recorded at import before
constant folding could erase it). `devices=` declares the physical devices (a count
or a list; by default the plan's own ranks, or device 0 for a single-device plan);
`device_map=` puts logical devices onto declared ones (eight ranks on one GPU for a
test). This holds for a single declared device too: a model pinning a tensor to
cuda:7 compiled for one device is a DeviceError here, not a crash at run time
(DESIGN.md failure 4). The error lists every missing device and what needs it.
"""

from __future__ import annotations

from kiln.errors import ArgumentError, DeviceError
from kiln.ir.graph import KilnGraph, where
from kiln.pipeline import as_pass

_SHOWN = 3  # ops listed per missing device


def declared_devices(devices, world: int) -> list[int]:
    """`devices=` as a list of device indices (a count n means 0..n-1)."""
    if devices is None:
        return list(range(max(world, 1)))
    if isinstance(devices, bool) or not isinstance(devices, (int, list, tuple, range)):
        raise ArgumentError(f"devices= must be a count or a list of device indices, got "
                            f"{devices!r}")
    out = list(range(devices)) if isinstance(devices, int) else list(devices)
    if not out or any(not isinstance(d, int) or d < 0 for d in out):
        raise ArgumentError(f"devices= must name at least one device index >= 0, got "
                            f"{devices!r}")
    return out


def _rank_needs(kg: KilnGraph) -> list[tuple[str, str | None]]:
    """What a rank of a multi-device plan runs: its collectives first, else its ops."""
    nodes = [n for n in kg.graph.nodes if n.op == "call_function"]
    coll = [n for n in nodes if str(n.target).startswith("kiln.all_")]
    return [(n.name, where(n)) for n in (coll or nodes)[:_SHOWN]]


def _ops(needs: list[tuple[str, str | None]]) -> str:
    return "\n".join(f"      {name}" + (f" at {line}" if line else "") for name, line in needs)


@as_pass(establishes=("devices-assigned",))
def assign_devices(kg: KilnGraph, ctx) -> KilnGraph:
    cfg = ctx.options.get("parallel")
    world = cfg.world_size if cfg is not None else 1
    declared = declared_devices(ctx.options.get("devices"), world)
    mapping = dict(ctx.options.get("device_map") or {})

    def absent(d: int) -> bool:
        return mapping.get(d, d) not in declared

    lines, first = [], None
    ranks = [r for r in range(world) if world > 1 and absent(r)]
    if ranks:
        needs = _rank_needs(kg)
        first = first or needs[0][1]
        lines.append(f"  devices {ranks}: ranks of the tp={cfg.tp} x pp={cfg.pp} plan; each "
                     f"runs its share of every op and joins the collectives, e.g.\n"
                     + _ops(needs))
    named = {d: list(nodes) for d, nodes in kg.devices_named.items()}
    for target, d in (ctx.options.get("pins") or {}).items():  # the user's pins
        named.setdefault(d, []).append((f"pins[{target!r}]", None))
    pinned = {d: nodes for d, nodes in sorted(named.items()) if absent(d)}
    for d, nodes in pinned.items():
        first = first or nodes[0][1]
        lines.append(f"  device {d}: named by the model's code in\n" + _ops(nodes[:_SHOWN]))
    missing = sorted({*ranks, *pinned})
    if missing:
        raise DeviceError(
            f"the plan needs devices {missing}, which are not declared (declared: "
            f"{declared}):\n" + "\n".join(lines),
            where=first,
            hint=f"declare them (kiln.compile(..., devices={max(missing) + 1}) or a list of "
            "indices), or map them onto declared devices (device_map={logical: physical})",
        )
    rank = cfg.rank if cfg is not None else 0
    device = mapping.get(rank, rank) if world > 1 else mapping.get(0, declared[0])
    for node in kg.graph.nodes:
        node.meta["device"] = device
    return kg
