"""Compile functions for the autotuner's tests: each plants a failure into some configs.

The tuner runs them inside its worker processes (ctx.options["tune_compiler"]), the
way it runs Triton's compiler. Each appends "<kernel> <config>" to the file named by
KILN_TEST_COMPILE_LOG before doing anything, so tests can count real compile attempts.
"""

import os
import time

from kiln.codegen.build.compiler import compile_binary


def _log(spec, config) -> None:
    path = os.environ.get("KILN_TEST_COMPILE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{spec.name} {config}\n")


def compile_counting(spec, config, target):
    _log(spec, config)
    return compile_binary(spec, config, target)


def compile_abort_on_8_warps(spec, config, target):
    """As Triton's C++ did for num_warps 8 (DESIGN.md failure 5): abort the process."""
    _log(spec, config)
    if config.num_warps == 8:
        os.abort()
    return compile_binary(spec, config, target)


def compile_hang_on_8_warps(spec, config, target):
    _log(spec, config)
    if config.num_warps == 8:
        while True:
            time.sleep(60)
    return compile_binary(spec, config, target)


def compile_abort_8_error_2(spec, config, target):
    """8 warps abort, 2 warps raise a compiler error, the rest compile for real."""
    _log(spec, config)
    if config.num_warps == 8:
        os.abort()
    if config.num_warps == 2:
        raise RuntimeError("planted compiler error for 2 warps")
    return compile_binary(spec, config, target)
