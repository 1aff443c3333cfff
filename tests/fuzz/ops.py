"""The whole op catalogue: importing this registers every op (see catalogue.py)."""

from tests.fuzz import ops_math, ops_shaped  # noqa: F401 - registers the ops
from tests.fuzz.catalogue import GEN, RENDER, WEIGHT

__all__ = ["GEN", "RENDER", "WEIGHT"]
