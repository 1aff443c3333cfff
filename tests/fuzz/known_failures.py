"""Failure classes the fuzzer has found and that are not fixed yet: signature -> issue.

The CI slice (test_fuzz_slice.py) tolerates exactly these, so CI stays green while
every known bug stays listed here (and in FINDINGS.md with a minimised repro under
tests/fuzz/repros/). When a fix lands, delete its entries: the slice then fails if the
class comes back. Signatures are oracle.normalise'd: `crash|target|stage|Type|message`,
`mismatch|target|kind|op+set`, `fallback|target|region kind|reason`.
"""

from __future__ import annotations

# Empty since 2026-11-24: every class found so far is fixed (FINDINGS.md).
KNOWN: dict[str, str] = {}


def is_known(signature: str) -> bool:
    return signature in KNOWN
