"""Failure classes the fuzzer has found and that are not fixed yet: signature -> issue.

The CI slice (test_fuzz_slice.py) tolerates exactly these, so CI stays green while
every known bug stays listed here (and in FINDINGS.md with a minimised repro under
tests/fuzz/repros/). When a fix lands, delete its entries: the slice then fails if the
class comes back. Signatures are oracle.normalise'd: `crash|target|stage|Type|message`,
`mismatch|target|kind|op+set`, `fallback|target|region kind|reason`.
"""

from __future__ import annotations

N1 = ('matmul template, N=1 (a weight or right operand with one column): the store '
    'writes a [BLOCK_M, 1]-shaped value through a [BLOCK_M, BLOCK_N] pointer '
    'block; on cuda targets every config fails and the region silently runs as '
    'torch ops (repro: (1,1,2,4) @ (4,1), repros/repro_seed100066_crash.py)')
SCALARSTORE = ('a block value stored through a scalar pointer when the output has one '
    'element per program: matmul with M=1 and N=1 ((3,) @ (3,1)), bmm with N=1, '
    'layer_norm over a size-1 axis (repros seed200, seed100040, seed100096)')
K1 = ('matmul template, K=1 (a reduction dim of size 1): tl.dot gets operands whose '
    'reduction dims differ ((D,1,1) @ (1,1), repro seed100036)')
ACC = ('matmul template with N=1 plus a bias (F.linear(x, W[1,K], b[1])): the '
    "accumulator's shape does not match tl.dot's result (repros seed30, "
    'seed100106)')
GEMV = ('the GEMV / outer-product form for K=1 or M=N=1 indexes a rank-0 value with '
    '[:, None] (v.unsqueeze(-1) @ W[1,N]; (1,1,1) @ (1,5); repros seed100224, '
    'seed100144)')
FLOATTO = ('a constant operand (full_like(x, 2.5)) reaches the matmul template as a '
    'Python float, which has no .to() (repro seed100020)')
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
GEMVCAT = ('F.linear of a vector (6,) with W (1,6), concatenated with a (1,) tensor: the '
    'interpret target returns garbage (4.6e29; reads memory it never wrote; repro '
    'seed200108)')
BF16BOOL = ("bf16 matmul with N=1, cast to bool, torch.where, permute: the interpreter's "
    'bf16 emulation reshapes a buffer of the wrong size (repro seed200231)')
SDPA1 = ('scaled_dot_product_attention with one query, one key and head dim 1, then a '
    'linear: tl.dot gets operands of rank < 2 (repro seed200399)')
I64BF16 = ("int64 -> bf16 cast on the interpret target returns the integers' bits, not "
    'their values (3 -> 2.8e-40; repros seed100202, seed100334)')

KNOWN: dict[str, str] = {
    ("crash|interpret|call|InterpreterError|AssertionError('accumulator shape is i"
     "ncompatible')"): ACC,
    ('fallback|cuda:sm_90|matmul|error: CompilationError: acc = tl.dot(tN, tN, acc'
     ', input_precision="ieee", out_dtype=tl.floatN) ^ accumulator shape is incomp'
     'atible'): ACC,
    ("crash|interpret|call|InterpreterError|ValueError('cannot reshape array of si"
     "ze N into shape (N,N)')"): BF16BOOL,
    ('crash|interpret|call|InterpreterError|TypeError("ufunc \'bitwise_and\' not sup'
     'ported for the input types, and the inputs could not be safely coerced to an'
     'y supported types according to the casting rul'): BITAND,
    ('crash|interpret|call|InterpreterError|TypeError("ufunc \'bitwise_or\' not supp'
     'orted for the input types, and the inputs could not be safely coerced to any'
     ' supported types according to the casting rule'): BITOR,
    ('crash|interpret|call|InterpreterError|AttributeError("\'float\' object has no '
     'attribute \'to\'")'): FLOATTO,
    ("crash|interpret|call|InterpreterError|ValueError('too many indices for tenso"
     "r of rank N')"): GEMV,
    ('fallback|cuda:sm_90|matmul|error: CompilationError: part = tl.sum(tN.to(tl.f'
     'loatN)[:, None] * w, N) ^ too many indices for tensor of rank N'): GEMV,
    'mismatch|interpret|values|cat+clamp_t+layer_norm+linear+mul+tanh': GEMVCAT,
    ('mismatch|interpret|values|add+affine+argmax+atan2+cast+exp+gelu+log_abs+mul+'
     'slice+squeeze+where'): I64BF16,
    ('mismatch|interpret|values|amax+arange_add+cast+cat+clamp_t+cumsum+le+logical'
     '_and+max_dim+prod+sub+sum_all+unsqueeze'): I64BF16,
    ('mismatch|interpret|values|argmax+argmin+cast+expand+logical_or+matmul_w+mean'
     '+remainder'): I64BF16,
    ("crash|interpret|call|InterpreterError|AssertionError('input and other must h"
     "ave equal reduction dimensions')"): K1,
    ('fallback|cuda:sm_90|matmul|error: CompilationError: acc = tl.dot(tN, tN, acc'
     ', input_precision="ieee", out_dtype=tl.floatN) ^ input and other must have e'
     'qual reduction dimensions'): K1,
    ('crash|interpret|call|InterpreterError|ValueError("Expected pointer argument '
     "to have shape ['constexpr[N]', 'constexpr[N]'] but got ['constexpr[N]', 'con"
     'stexpr[N]\']")'): N1,
    ('fallback|cuda:sm_90|matmul|error: CompilationError: tl.store(out_ptrN + (N *'
     " pid_b + rmN), tN, m_ok & n_ok) ^ Expected pointer argument to have shape ['"
     "constexpr[N]', 'constexpr[N]'] but "): N1,
    ('fallback|cuda:sm_90|matmul|error: CompilationError: tl.store(out_ptrN + (rmN'
     "), acc, m_ok & n_ok) ^ Expected pointer argument to have shape ['constexpr[N"
     "]', 'constexpr[N]'] but got ['const"): N1,
    ('fallback|cuda:sm_90|matmul|error: CompilationError: tl.store(out_ptrN + (rmN'
     "), tN, m_ok & n_ok) ^ Expected pointer argument to have shape ['constexpr[N]"
     "', 'constexpr[N]'] but got ['conste"): N1,
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
