"""kiln.compile's arguments besides the model, checked before any work is done.

A misspelt option or a pin given as a list used to surface minutes later as a raw
TypeError from whichever pass first read it, or not at all (an unknown option was
ignored). Each is checked here against what the passes accept, so the error names
the argument the user wrote.
"""

from __future__ import annotations

import difflib
import os

from kiln.codegen.autotune.candidates import MODES
from kiln.errors import ArgumentError
from kiln.frontend.export import FALLBACK_MODES

# The options a user may pass (kiln.codegen.autotune.tuner reads them); the passes'
# own entries in ctx.options (fallback, parallel, ...) are keyword arguments instead.
OPTIONS = ("tune", "tune_compiler", "tune_timeout", "tune_workers", "compile_cache",
           "mask_envelope", "query_prologue_split", "key_prologue_split", "narrow_version")
# On/off options for measuring a dispatch choice: what False does.
_MEASURING = {"mask_envelope": "walks every key block of a masked attention",
              "query_prologue_split": "keeps a prefill attention's query prologue (RoPE) "
              "in its kernel",
              "key_prologue_split": "keeps a prefill attention's key and value prologues "
              "(RoPE, a k norm) in its key loop",
              "narrow_version": "compiles one plan for every size (a decode batch's "
              "one row runs tiled products too)"}
_KEYWORDS = ("fallback", "allow_train", "parallel", "devices", "device_map", "pins")


def check_kwargs(kwargs) -> dict:
    """`kwargs` (the model's keyword arguments) as a fresh dict."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ArgumentError(f"kwargs must be a dict of the model's keyword arguments, got "
                            f"{type(kwargs).__name__}",
                            hint="kiln.compile(model, args, {'name': tensor}); positional "
                            "arguments go in args")
    return dict(kwargs)


COMPILE_KEYWORDS = ("dynamic_shapes", "target", "compile_to", "dump_ir", "options",
                    "parallel", "devices", "device_map", "pins", "fallback", "allow_train",
                    "max_modules")


def check_stray_keywords(stray: dict) -> None:
    """kiln.compile's keywords are its own; the model's go in `kwargs` (as torch.export's).
    `kiln.compile(model, (ids,), use_cache=False)` names the model's argument, not a raw
    TypeError from Python."""
    if not stray:
        return
    names = ", ".join(stray)
    known = [m for n in stray for m in difflib.get_close_matches(n, COMPILE_KEYWORDS, 1)]
    if known:
        hint = f"did you mean {', '.join(known)}?"
    else:
        model_kw = ", ".join(f"{k!r}: {v!r}" if not hasattr(v, "shape") else f"{k!r}: ..."
                             for k, v in stray.items())
        hint = (f"the model's keyword arguments go in kwargs: kiln.compile(model, args, "
                f"kwargs={{{model_kw}}}); kiln.compile's own are "
                f"{', '.join(COMPILE_KEYWORDS)}")
    raise ArgumentError(f"kiln.compile got keyword argument(s) it does not take: {names}",
                        hint=hint)


def check_options(options) -> dict:
    """`options=` as a fresh dict, every key known and every value of the right kind."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ArgumentError(f"options= must be a dict, got {type(options).__name__} "
                            f"{options!r}", hint="e.g. options={'tune': 'none'}")
    for key in options:
        if key not in OPTIONS:
            raise ArgumentError(f"unknown option {key!r}", hint=_option_hint(key))
    tune = options.get("tune")
    if tune is not None and tune not in MODES:
        raise ArgumentError(f"options['tune'] is {tune!r}, not one of {', '.join(MODES)}")
    timeout = options.get("tune_timeout")
    if timeout is not None and (not _is_number(timeout) or not timeout > 0):
        raise ArgumentError(f"options['tune_timeout'] must be a positive number of seconds, "
                            f"got {timeout!r}")
    workers = options.get("tune_workers")
    if workers is not None and (not _is_int(workers) or workers < 1):
        raise ArgumentError(f"options['tune_workers'] must be a positive int, got {workers!r}")
    cache = options.get("compile_cache")
    if cache is not None and not isinstance(cache, bool):
        raise ArgumentError(f"options['compile_cache'] must be True or False, got {cache!r}")
    for key, off in _MEASURING.items():
        value = options.get(key)
        if value is not None and not isinstance(value, bool):
            raise ArgumentError(f"options[{key!r}] must be True or False, got {value!r}",
                                hint=f"False {off} (for measuring what it gives)")
    compiler = options.get("tune_compiler")
    if compiler is not None and not isinstance(compiler, str):
        raise ArgumentError(f"options['tune_compiler'] must be an import path string "
                            f"('package.module:function'), got {compiler!r}")
    return dict(options)


def _option_hint(key) -> str:
    if key in _KEYWORDS:
        return f"{key} is a keyword argument of kiln.compile: kiln.compile(..., {key}=...)"
    close = difflib.get_close_matches(str(key), OPTIONS, n=1)
    return (f"did you mean {close[0]!r}? " if close else "") + \
        f"options are: {', '.join(OPTIONS)}"


def check_fallback(fallback) -> None:
    if fallback not in FALLBACK_MODES:
        raise ArgumentError(f"fallback={fallback!r} is not one of {', '.join(FALLBACK_MODES)}",
                            hint='fallback="allow" runs ops kiln has no kernel for as '
                            'PyTorch\'s own; fallback="error" refuses them')


def check_lazy(lazy: bool, compile_to, dump_ir, max_modules) -> None:
    """The keywords only one form takes: compile_to and dump_ir need example args (they
    return or write the IR of a compile that happens now); max_modules bounds the lazy
    form (no example args), which compiles once per call signature."""
    if not lazy:
        if max_modules is not None:
            raise ArgumentError(
                "max_modules= bounds how many modules kiln.compile(model) compiles without "
                "example args, one per call signature; this call gives example args, which "
                "compile exactly one", where="kiln.compile(model, args, max_modules=...)",
                hint="leave max_modules out, or leave the example args out to compile lazily")
        return
    for name, value in (("compile_to", compile_to), ("dump_ir", dump_ir)):
        if value is not None:
            raise ArgumentError(
                f"{name}= needs example args: without them kiln.compile(model) compiles "
                "on the module's first call, which returns the model's outputs, not IR",
                where=f"kiln.compile(model, {name}=...)",
                hint=f"pass example args: kiln.compile(model, args, {name}=...)")
    if max_modules is not None and (not _is_int(max_modules) or max_modules < 1):
        raise ArgumentError(f"max_modules= must be a positive int, got {max_modules!r}",
                            hint="e.g. max_modules=8 (the default), as torch.compile's "
                            "recompile limit")


def check_dump_dir(dump_ir) -> None:
    """`dump_ir=` must be a path, of a directory or of nothing yet."""
    if dump_ir is None:
        return
    if not isinstance(dump_ir, (str, os.PathLike)):
        raise ArgumentError(f"dump_ir= must be a directory path, got "
                            f"{type(dump_ir).__name__} {dump_ir!r}")


def check_device_map(device_map) -> dict[int, int] | None:
    """`device_map=` as {logical device: declared device}, both non-negative ints."""
    if device_map is None:
        return None
    if not isinstance(device_map, dict) or not all(
            _is_int(k) and _is_int(v) and k >= 0 and v >= 0 for k, v in device_map.items()):
        raise ArgumentError(f"device_map= must map device indices to device indices, got "
                            f"{device_map!r}", hint="e.g. device_map={1: 0} runs logical "
                            "device 1 on device 0")
    return dict(device_map)


def check_pins(pins) -> dict[str, int] | None:
    """`pins=` as {state name: device index}."""
    if pins is None:
        return None
    if not isinstance(pins, dict) or not all(
            isinstance(k, str) and _is_int(v) and v >= 0 for k, v in pins.items()):
        raise ArgumentError(f"pins= must map state names to device indices, got {pins!r}",
                            hint="e.g. pins={'lm_head.weight': 1}")
    return dict(pins)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
