"""Every KILN_* environment setting, with its default and what it does.

Readers call these functions instead of os.environ, so the list below is the whole
story. Each reads the environment at call time: a setting changed while the process
runs (a test's monkeypatch, the CLI's --verbose) takes effect at the next read.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import tempfile
from pathlib import Path

from kiln.errors import KilnError

# name -> (default, what it does); README's "Environment" section points here.
SETTINGS: dict[str, tuple[str | None, str]] = {
    "KILN_LOG": (None, "<stage>[,<stage>] or all: log those stages (kiln.<stage> loggers) "
                 "to stderr, when kiln is used as a library as well as from the CLI"),
    "KILN_DUMP_IR": (None, "<dir>: write the printed IR after every pass into <dir>"),
    "KILN_CACHE_DIR": ("~/.cache/kiln", "generated kernel sources, tuning results and the "
                       "autotuner's quarantine"),
    "KILN_PROGRESS": (None, "0|1: force progress bars off or on (default: on when stderr "
                      "is a terminal)"),
    "KILN_TUNE": ("fast", "none|fast|full: the autotuner's default mode (kiln.compile's "
                  "options={'tune': ...} and `kiln compile --tune` override it)"),
    "KILN_TUNE_OVERLAP": ("1", "1: with a GPU to time on, the autotuner times each kernel "
                          "as soon as its own candidates are compiled, while the others "
                          "compile (a cold 8B LLM compile 106 -> 93 s on an H200); 0: all "
                          "builds first, then all timing"),
    "KILN_TUNE_TIMING": ("worker", "worker|inprocess: where the autotuner times and checks "
                         "candidates on the GPU: in its run worker, whose CUDA context a "
                         "faulting candidate may poison, or in the compiling process "
                         "itself (the old way, for debugging a kernel under a debugger)"),
    "KILN_COMPILE_CACHE": ("1", "0: never keep or reuse compiled modules in KILN_CACHE_DIR "
                           "(kiln.compile's options={'compile_cache': False} for one "
                           "compile); tuning results are kept either way"),
    "KILN_DECOMPOSE": ("local", "local|retrace: how a captured program is lowered to core "
                       "ATen: node by node (torch >= 2.13; seconds for an 8B, where torch's "
                       "whole-program re-trace takes tens of seconds; programs it cannot "
                       "take and older torch get the re-trace), or always by the re-trace"),
    "KILN_PDL": ("1", "0: launch kiln's kernels the ordinary way, not as programmatic "
                 "dependents (on Hopper and later GPUs, by default, each is scheduled while "
                 "its predecessor drains and waits for its results: 2-4.5% off an 8B "
                 "decode step on an H200)"),
    "KILN_FP8_GEMV_PACKED": ("1", "0: the one-token fp8 GEMV multiplies in fp32 as Triton "
                             "writes it, not in packed fp16 through inline PTX (NVIDIA "
                             "GPUs; for comparisons, or should a driver's PTX reject it)"),
    "KILN_FP8_GEMM_TMA": ("1", "0: the block-scaled fp8 GEMM (prefill) loads its tiles by "
                          "pointer loads, not through the tensor memory accelerator (TMA "
                          "descriptors, Hopper and later: by default; 8-50% faster a GEMM "
                          "on an H200, Llama-3-8B fp8 prefill 2048 -8%)"),
    "KILN_DIST_TIMEOUT": ("300", "seconds a rank waits on its peers (a collective, a "
                          "transfer) before a dead or stuck peer is a DistributedError"),
}


# the settings that change the kernels kiln builds or how it launches them: a benchmark
# records them (kiln bench's JSON) so that two runs say what they compared
SPEED_SETTINGS = ("KILN_TUNE", "KILN_TUNE_TIMING", "KILN_TUNE_OVERLAP", "KILN_DECOMPOSE",
                  "KILN_PDL", "KILN_FP8_GEMV_PACKED", "KILN_FP8_GEMM_TMA")


def effective(names=SPEED_SETTINGS) -> dict[str, str | None]:
    """Each setting's value in this environment, its default where unset."""
    return {n: (_get(n) or "").strip() or SETTINGS[n][0] for n in names}


def _get(name: str) -> str | None:
    return os.environ.get(name)


def log_stages() -> list[str]:
    """The logger names KILN_LOG asks for: ["kiln"] for all, else ["kiln.<stage>", ...]."""
    spec = (_get("KILN_LOG") or "").strip()
    if not spec:
        return []
    if spec == "all":
        return ["kiln"]
    return [f"kiln.{s.strip()}" for s in spec.split(",") if s.strip()]


def dump_ir_dir() -> Path | None:
    d = _get("KILN_DUMP_IR")
    return Path(d) if d else None


def cache_dir() -> Path:
    """KILN_CACHE_DIR (created if missing). One that cannot be created or written is
    replaced, for this process, by a private temporary directory, with a warning:
    compiling must not fail because a cache cannot be kept."""
    d = Path(_get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")
    try:
        d.mkdir(parents=True, exist_ok=True)
        if not os.access(d, os.W_OK):
            raise PermissionError(f"{d} is not writable")
    except OSError as e:
        return _stand_in_cache(str(d), str(e))
    return d


@functools.cache
def _stand_in_cache(wanted: str, why: str) -> Path:
    logging.getLogger("kiln").warning(
        "kiln cache %s cannot be used (%s): compiling with a temporary cache that is "
        "not kept; set KILN_CACHE_DIR to a writable directory", wanted, why)
    return Path(tempfile.mkdtemp(prefix="kiln-cache-"))


def progress_enabled() -> bool:
    flag = _get("KILN_PROGRESS")
    if flag is not None:
        return flag not in ("0", "", "false", "no")
    return sys.stderr.isatty()


def tune_mode() -> str | None:
    """KILN_TUNE, or None when unset (the tuner then uses its own default)."""
    return _get("KILN_TUNE") or None


def tune_timing() -> str:
    """KILN_TUNE_TIMING: "worker" or "inprocess" (anything else is a KilnError)."""
    value = (_get("KILN_TUNE_TIMING") or SETTINGS["KILN_TUNE_TIMING"][0]).strip().lower()
    if value not in ("worker", "inprocess"):
        raise KilnError(f"KILN_TUNE_TIMING={value!r} is not a timing place",
                        hint="set it to 'worker' (the default) or 'inprocess'")
    return value


def tune_overlap() -> bool:
    """KILN_TUNE_OVERLAP: time kernels while the rest compile (default on)."""
    return (_get("KILN_TUNE_OVERLAP") or "1").strip().lower() in ("1", "true", "yes")


def compile_cache_enabled() -> bool:
    """KILN_COMPILE_CACHE: keep and reuse compiled modules (default on)."""
    return (_get("KILN_COMPILE_CACHE") or "1").strip().lower() not in ("0", "false", "no")


def local_decompose() -> bool:
    """KILN_DECOMPOSE: "local" (the default: node by node where it can) or "retrace"
    (torch's re-trace always); anything else is a KilnError."""
    value = (_get("KILN_DECOMPOSE") or SETTINGS["KILN_DECOMPOSE"][0]).strip().lower()
    if value not in ("local", "retrace"):
        raise KilnError(f"KILN_DECOMPOSE={value!r} is not a way to decompose",
                        hint="set it to 'local' (the default) or 'retrace'")
    return value == "local"


def pdl_enabled() -> bool:
    """KILN_PDL: programmatic dependent launch on GPUs that have it (default on)."""
    return (_get("KILN_PDL") or "1").strip().lower() not in ("0", "false", "no")


def fp8_gemv_packed() -> bool:
    """KILN_FP8_GEMV_PACKED: the fp8 GEMV's packed fp16 products (default on)."""
    return (_get("KILN_FP8_GEMV_PACKED") or "1").strip().lower() not in ("0", "false", "no")


def fp8_gemm_tma() -> bool:
    """KILN_FP8_GEMM_TMA: the fp8 GEMM's tiles through TMA on Hopper+ (default on)."""
    return (_get("KILN_FP8_GEMM_TMA") or "1").strip().lower() not in ("0", "false", "no")


def dist_timeout_s() -> float:
    """KILN_DIST_TIMEOUT: how long a collective may wait for a peer, in seconds."""
    return float(_get("KILN_DIST_TIMEOUT") or SETTINGS["KILN_DIST_TIMEOUT"][0])


def setup_logging(verbose: bool = False) -> None:
    """Send the kiln.<stage> loggers KILN_LOG names to stderr (once per logger).

    Called when kiln is imported and at each kiln.compile / kiln.load, so library
    users get the same logs as the CLI. `verbose` (the CLI's -v) means KILN_LOG=all
    unless KILN_LOG is set; it is set in the environment so autotune workers log too.
    """
    if verbose:
        os.environ.setdefault("KILN_LOG", "all")
    for name in log_stages():
        lg = logging.getLogger(name)
        lg.setLevel(logging.INFO)
        if not any(getattr(h, "_kiln_log", False) for h in lg.handlers):
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            handler._kiln_log = True
            lg.addHandler(handler)
