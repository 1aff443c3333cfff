"""Failure classes the fuzzer has found and that are not fixed yet: signature -> issue.

The CI slice (test_fuzz_slice.py) tolerates exactly these, so CI stays green while
every known bug stays listed here (and in FINDINGS.md with a minimised repro). When
a fix lands, delete its entry: the slice then fails if the class comes back. A
signature is oracle.normalise'd: `crash|target|stage|Type|message`,
`mismatch|target|kind|op+set`, `fallback|target|region kind|reason`.
"""

from __future__ import annotations

KNOWN: dict[str, str] = {}


def is_known(signature: str) -> bool:
    # a call's stage carries the size it ran at (call@7): any size is the same class
    parts = signature.split("|")
    if len(parts) > 2:
        parts[2] = parts[2].split("@")[0]
    plain = "|".join(parts)
    return plain in KNOWN or signature in KNOWN
