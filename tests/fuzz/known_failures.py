"""Failure classes the fuzzer has found and that are not fixed yet: signature -> issue.

The CI slice (test_fuzz_slice.py) tolerates exactly these, so CI stays green while
every known bug stays listed here (and in FINDINGS.md with a minimised repro under
tests/fuzz/repros/). When a fix lands, delete its entries: the slice then fails if the
class comes back. Signatures are oracle.normalise'd: `crash|target|stage|Type|message`,
`mismatch|target|kind|op+set`, `fallback|target|region kind|reason`.
"""

from __future__ import annotations

SCALARSTORE = ('a block value stored through a scalar pointer when the output has one '
    'element per program: layer_norm over a size-1 axis (repro seed100040; the '
    "matmul template's cases, seed200 and seed100096, are fixed)")
VERIFY = ('form_regions leaves a region reading %clamp: torch.clamp(x, min=x) consumed '
    'by a reshape and a transpose that are both outputs (repro seed241; a '
    'dispatch pass, seen on cpu)')
VERIFY2 = ('form_regions drops a plan output: a chunk of a bool tensor returned both as '
    'itself and reshaped (repro seed200028; a dispatch pass, seen on cpu)')
SDPA1 = ('scaled_dot_product_attention with one query, one key and head dim 1, then a '
    'linear: tl.dot gets operands of rank < 2 (repro seed200399)')

KNOWN: dict[str, str] = {
    ("crash|interpret|call|InterpreterError|ValueError('Value argument cannot be b"
     "lock type if pointer argument is not a block')"): SCALARSTORE,
    ('fallback|cuda:sm_90|reduction|error: CompilationError: tl.store(out_ptrN + ('
     'N), tN, xmask) ^ Value argument cannot be block type if pointer argument is '
     'not a block'): SCALARSTORE,
    ("crash|interpret|call|InterpreterError|AssertionError('input and other must h"
     "ave equal ranks >= N')"): SDPA1,
    ('crash|cpu|compile|VerifierError|IR verification failed after pass dispatch/f'
     'orm_regions: region # reads unknown value %clamp'): VERIFY,
    ('crash|cpu|compile|VerifierError|IR verification failed after pass dispatch/f'
     'orm_regions: plan output %slice_N is never produced'): VERIFY2,
}


def is_known(signature: str) -> bool:
    return signature in KNOWN
