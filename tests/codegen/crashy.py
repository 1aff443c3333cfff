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


def measure_planted(task):
    """A run worker's runner (ctx.options["tune_runner"]) that plants run-time faults.

    KILN_TEST_RUN_PLAN (JSON) says per config ("extern" for the torch form) what its
    run does: a number of ms; "fault" (raises what torch raises after an illegal
    address); "exit" (the worker dies mid-run); "hang"; or {"ms": n, "wrong": true}
    (times n, its outputs mismatch). Each run appends "<what> <config> <input shapes>"
    to KILN_TEST_RUN_LOG; the inputs are made here from their description, as the
    real runner does.
    """
    import json

    from kiln.codegen.autotune.timing import make_buffers
    from kiln.codegen.build.spec import Config

    inputs, _ = make_buffers(task["buffers"], "cpu", task["seed"])
    name = str(Config.from_json(task["config"])) if task["config"] else "extern"
    shapes = ",".join(f"{k}={tuple(v.shape)}" for k, v in sorted(inputs.items()))
    with open(os.environ["KILN_TEST_RUN_LOG"], "a") as f:
        f.write(f"{task['what']} {name} {shapes}\n")
    action = json.loads(os.environ["KILN_TEST_RUN_PLAN"])[name]
    if isinstance(action, dict):
        if task["what"] == "time":
            return {"ms": action["ms"]}
        if action["check"] == "wrong":
            return {"mismatch": "out: planted mismatch"}
        action = action["check"]
    if action == "fault":
        raise RuntimeError("CUDA error: an illegal memory access was encountered\n"
                           "CUDA kernel errors might be asynchronously reported")
    if action == "exit":
        os._exit(7)
    if action == "hang":
        while True:
            time.sleep(60)
    return {"ms": action} if task["what"] == "time" else {"mismatch": None}


def compile_stand_in(spec, config, target):
    """A Binary with no code (tests whose candidates never run a real kernel: the
    planted runner only looks at the config): skips seconds of Triton per config."""
    from kiln.codegen.build.compiler import Binary, Resources

    _log(spec, config)
    threads = config.num_warps * 32
    return Binary(spec.name, {}, {"cubin": b""}, Resources(0, 32, 0, threads), "cubin")


def compile_gated(spec, config, target):
    """compile_stand_in, but a kernel named "transpose" waits (up to 30 s) for the file
    KILN_TEST_COMPILE_GATE to exist: a compile still running while others are timed."""
    gate = os.environ.get("KILN_TEST_COMPILE_GATE")
    if spec.name == "transpose" and gate:
        deadline = time.monotonic() + 30
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.05)
    return compile_stand_in(spec, config, target)
