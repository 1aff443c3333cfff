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
BITAND = ('logical_and of two fp16 tensors is emitted as a bitwise and on the floats '
    '(repro seed100082)')
BITOR = ('torch.minimum (NaN-propagating form) emits a bitwise or on fp32 values when '
    'one operand broadcasts (repro seed100282)')
RESHAPE = ("bool -> bf16 cast of a transposed comparison: the interpreter's bf16 "
    'emulation reshapes a buffer of the wrong byte size (repro seed100308)')
VERIFY = ('form_regions leaves a region reading %clamp: torch.clamp(x, min=x) consumed '
    'by a reshape and a transpose that are both outputs (repro seed241; a '
    'dispatch pass, seen on cpu)')
VERIFY2 = ('form_regions drops a plan output: a chunk of a bool tensor returned both as '
    'itself and reshaped (repro seed200028; a dispatch pass, seen on cpu)')
BF16BOOL = ("bf16 matmul with N=1, cast to bool, torch.where, permute: the interpreter's "
    'bf16 emulation reshapes a buffer of the wrong size (repro seed200231)')
SDPA1 = ('scaled_dot_product_attention with one query, one key and head dim 1, then a '
    'linear: tl.dot gets operands of rank < 2 (repro seed200399)')
I64BF16 = ("int64 -> bf16 cast on the interpret target returns the integers' bits, not "
    'their values (3 -> 2.8e-40; repros seed100202, seed100334)')

KNOWN: dict[str, str] = {
    ("crash|interpret|call|InterpreterError|ValueError('cannot reshape array of si"
     "ze N into shape (N,N)')"): BF16BOOL,
    ('crash|interpret|call|InterpreterError|TypeError("ufunc \'bitwise_and\' not sup'
     'ported for the input types, and the inputs could not be safely coerced to an'
     'y supported types according to the casting rul'): BITAND,
    ('crash|interpret|call|InterpreterError|TypeError("ufunc \'bitwise_or\' not supp'
     'orted for the input types, and the inputs could not be safely coerced to any'
     ' supported types according to the casting rule'): BITOR,
    ('mismatch|interpret|values|add+affine+argmax+atan2+cast+exp+gelu+log_abs+mul+'
     'slice+squeeze+where'): I64BF16,
    ('mismatch|interpret|values|amax+arange_add+cast+cat+clamp_t+cumsum+le+logical'
     '_and+max_dim+prod+sub+sum_all+unsqueeze'): I64BF16,
    ('mismatch|interpret|values|argmax+argmin+cast+expand+logical_or+matmul_w+mean'
     '+remainder'): I64BF16,
    ("crash|interpret|call|InterpreterError|ValueError('cannot reshape array of si"
     "ze N into shape (N,)')"): RESHAPE,
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
