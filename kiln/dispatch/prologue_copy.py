"""A region takes a copy of another region's ops as its prologue (the passes that fold a
value into the regions that read it: fold_rmsnorm.py, recompute_cheap.py)."""

from __future__ import annotations

import copy

from kiln.ir.plan import Op, Region


def copy_prologue(reader: Region, producer: Region, ops: list[Op], note: str) -> None:
    """`reader` computes `ops` (of `producer`, whose value it read) itself, first; its
    inputs become what its ops (and an attention's key bounds) now read."""
    names = {o.name for o in ops}
    reader.ops = [copy.deepcopy(o) for o in ops] + [o for o in reader.ops
                                                     if o.name not in names]
    used = {r for o in reader.ops for r in o.refs()} - {o.name for o in reader.ops}
    # an attention's mask envelope: read, not an op's
    used |= set(reader.key_bound_values())
    reader.inputs = [v for v in dict.fromkeys(producer.inputs + reader.inputs) if v in used]
    reader.notes.append(note)
