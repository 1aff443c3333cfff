"""Run an interpreted Triton kernel in a process that also compiles for GPUs.

Triton's own jit'd library functions (tl.max, tl.sum, tl.zeros, ...) were built when
triton was imported, without the interpreter; while an interpreted kernel runs they
are swapped for interpreted twins (`_interpreted_stdlib`), and put back after, so
GPU compiles in the same process see the originals.

The interpreter also labels a comparison's result with its operands' type: a scalar
`x != 0` on fp16 became an fp16 0/1 once broadcast against a block, and `&` with a
real boolean then failed (the fuzzer's logical_and / minimum crashes). While a kernel
runs, comparisons are labelled int1 (`_boolean_comparisons`), as on a GPU; and casts
between bf16 (stored as uint16 bits) and integers or booleans go through fp32, as
its fp32 <-> bf16 cast does, instead of converting the bits (3 -> 2.8e-40), and
anything -> bf16 rounds to nearest even, as a GPU and eager PyTorch do (the
interpreter truncated: 279 -> 278).

Triton 3.6's interpreter reads a tensor used as an index (a `range` bound) with
int(data), which NumPy 2.4 refuses for the one-element 1-D arrays program ids are
("only 0-dimensional arrays can be converted to Python scalars": every K split's
loop); later Triton squeezes first, and so does `_scalar_index` while a kernel runs.

On a GPU a load or store through a pointer past a tensor reads garbage or faults; in
the interpreter it is a raw NumPy access of host memory: a read returns whatever lies
there and a write corrupts the heap (a KV cache written past its end aborted the
process with a double free). So on the interpret target the generated code checks
each index it loads from a tensor (`tl.device_assert`, message INDEX_CHECK), and a
kernel carrying such checks runs with the interpreter's debug option on (`debug=True`
on Interpreted: swapped into the interpreter's builder for that launch only, as
Triton's interpreter reads no TRITON_DEBUG; its integer-overflow checks, which the
same option would turn on, stay off). `failed_index_check` finds a failed check in
the interpreter's error. GPU targets emit no checks.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from contextlib import contextmanager, nullcontext, suppress

_lock = threading.Lock()

# the message every index check of generated code starts with (then the op, in brackets)
INDEX_CHECK = "kiln: index out of range"


class Interpreted:
    """An interpreter kernel launched as `fn[grid](*args)`, with the stdlib interpretable;
    `debug`: its `tl.device_assert`s are checked (off, the interpreter skips them)."""

    def __init__(self, fn, debug: bool = False):
        self.fn = fn
        self.debug = debug

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with _interpreted_stdlib(), (_debug() if self.debug else nullcontext()):
                return self.fn[grid](*args, **kwargs)

        return launch


@contextmanager
def _debug():
    """The interpreter's device asserts checked while a kernel runs (called under _lock).

    Triton's interpreter builds every kernel with one builder whose options say whether
    `tl.device_assert` does anything; TRITON_DEBUG does not reach them. The same
    option would also check every 32-bit integer add and multiply for overflow
    (`sanitize_overflow`), checks kiln did not ask for that slow every launch, so
    those are turned off for the launch."""
    from triton.runtime.interpreter import interpreter_builder

    original = interpreter_builder.options
    interpreter_builder.options = dataclasses.replace(original, debug=True,
                                                      sanitize_overflow=False)
    try:
        yield
    finally:
        interpreter_builder.options = original


def failed_index_check(e: BaseException) -> str | None:
    """The message of the generated index check that failed in the interpreter's error
    `e` (it wraps the kernel's AssertionError), or None if `e` is something else."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, AssertionError) and str(e).startswith(INDEX_CHECK):
            return str(e)
        e = e.__cause__ or e.__context__
    return None


_twins: dict[int, object] = {}


@functools.cache
def _twin_class():
    """InterpretedFunction whose device-function call undoes its patches of triton.language.

    Triton's interpreter patches triton.language for a device function call and never
    restores it (harmless when the whole process is interpreted). Here the process also
    compiles for GPUs, so the patches of a call are rolled back when it returns (the
    kernel's own patches stay until the kernel's launch ends).
    """
    from triton.runtime.interpreter import InterpretedFunction, InterpreterError, _patch_lang

    class Twin(InterpretedFunction):
        def __call__(self, *args, **kwargs):
            scope = _patch_lang(self.fn)
            try:
                return self.rewrite()(*args, **kwargs)
            except Exception as e:
                raise InterpreterError(repr(e)) from e
            finally:
                scope.restore()

    return Twin


@contextmanager
def _interpreted_stdlib():
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    with suppress(ImportError):  # imported lazily by the launcher: let it see the originals
        import triton.experimental.gluon  # noqa: F401
    modules = [tl, tl.core, tl.standard, tl.math]
    saved = []
    with _lock, _boolean_comparisons(), _scalar_index():
        try:
            for mod in modules:
                for attr, val in list(vars(mod).items()):
                    if isinstance(val, JITFunction):
                        twin = _twins.get(id(val))
                        if twin is None:
                            twin = _twins[id(val)] = _twin_class()(val.fn)
                        saved.append((mod, attr, val))
                        setattr(mod, attr, twin)
            yield
        finally:
            for mod, attr, val in saved:
                setattr(mod, attr, val)


@contextmanager
def _scalar_index():
    """While a kernel runs, a one-element tensor converts to an index (Triton 3.6)."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:  # a Triton that patches its tensors another way
        yield
        return

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch
    try:
        yield
    finally:
        interpreter._patch_lang_tensor = original


_COMPARISONS = ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal")


@contextmanager
def _boolean_comparisons():
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    original, original_cast = InterpreterBuilder.binary_op, InterpreterBuilder.cast_impl

    def binary_op(self, lhs, rhs, op):
        if getattr(op, "__name__", "") in _COMPARISONS:
            return TensorHandle(np.asarray(op(lhs.data, rhs.data)), tl.int1)
        return original(self, lhs, rhs, op)

    def cast_impl(self, src, dst_type):
        ends = (src.dtype.scalar, dst_type.scalar)
        if ends[1] == tl.bfloat16 and ends[0] != tl.bfloat16:
            wide = original_cast(self, src, tl.float32) if ends[0] != tl.float32 else src
            return TensorHandle(_to_bf16_bits(wide.data), tl.bfloat16)
        if ends[0] == tl.bfloat16 and not ends[1].is_floating():
            return original_cast(self, original_cast(self, src, tl.float32), dst_type)
        return original_cast(self, src, dst_type)

    InterpreterBuilder.binary_op = binary_op
    InterpreterBuilder.cast_impl = cast_impl
    try:
        yield
    finally:
        InterpreterBuilder.binary_op = original
        InterpreterBuilder.cast_impl = original_cast


def _to_bf16_bits(f32):
    """fp32 values -> bf16 bit patterns (uint16), rounded to nearest even; NaN stays NaN."""
    import numpy as np

    bits = np.asarray(f32, dtype=np.float32).view(np.uint32)
    rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
    nan = np.isnan(np.asarray(f32, dtype=np.float32))
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)
