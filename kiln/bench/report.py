"""What `kiln bench` writes: a table, a JSON file, a chart, and the baseline check.

The JSON is also the baseline format: `--check` compares kiln's milliseconds row by row
(rows are keyed "phase tokens bB", "phase tokens bB fp8" for the fp8 model) with a
stored run and fails on any row more than the tolerance slower, so a slowdown like the
ones DESIGN.md's failure 3 describes (fp8 Llama's prefill and decode) stops a change
instead of shipping. Rows the baseline lacks are listed, not failed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kiln.bench.gpu_clock import CAPPED
from kiln.bench.sweep import Result

PEERS = ("eager", "torch.compile")


def to_json(result: Result, settings: dict | None = None) -> dict:
    """`settings`: the KILN_* settings the run was built and launched with (the CLI's)."""
    p, f = result.plan, result.floors
    return {
        "device": result.device_name, "torch": torch.__version__,
        "preset": p.preset, "layers": p.shape().layers, "dtype": str(p.dtype).split(".")[-1],
        "quantize": p.quantize, "settings": settings or {},
        "floors": {**_rates(f),
                   # each measurement (the run's start, its end): `floors` is their best
                   "measured": [_rates(m) for m in result.measured]},
        "compile_s": result.compile_s,
        "rows": [{"key": r.key, "phase": r.phase, "tokens": r.tokens, "batch": r.batch,
                  "quantize": r.quantize, "floor_ms": r.floor_ms, "ms": r.ms,
                  "rel_err": r.rel_err, "host_ms": r.host_ms, "gpu": r.gpu}
                 for r in result.rows],
    }


def _rates(f) -> dict:
    return {"copy_GBps": f.copy_bytes_per_s / 1e9, "matmul_TFLOPs": f.matmul_flops_per_s / 1e12,
            "fp8_matmul_TFLOPs": (f.fp8_matmul_flops_per_s / 1e12
                                  if f.fp8_matmul_flops_per_s else None)}


# Measured (benchmarks/RESULTS.md, 2026-11-28 fifth session): a 1e-3 change of the 8B's
# embedding output moves its fp8 logits by ~0.2 (8 layers) and its fp16 ones by ~0.009.
FP8_ERR_NOTE = ("fp8 rows' max err is against eager's fp8 form: rounding activations to "
                "e4m3 makes a random-weight model chaotic (a 1e-3 input change moves the 8B's "
                "fp8 logits ~0.2), so 0.1-0.3 there measures that; the fp8 kernels are held "
                "to the op by kiln's tests")


def table(data: dict) -> str:
    """Milliseconds per runner and kiln's ratios to the floor and to each peer."""
    fp8_rate = data["floors"].get("fp8_matmul_TFLOPs")
    lines = [f"kiln bench: {data['preset']} ({data['layers']} layers, {data['dtype']}) on "
             f"{data['device']}, torch {data['torch']}",
             f"floors: copy {data['floors']['copy_GBps']:.0f} GB/s, matmul "
             f"{data['floors']['matmul_TFLOPs']:.1f} TFLOP/s"
             + (f", fp8 matmul {fp8_rate:.1f} TFLOP/s" if fp8_rate else "")
             + _measured(data["floors"].get("measured", [])),
             *(["settings: " + " ".join(f"{k}={v}" for k, v in data["settings"].items())]
               if data.get("settings") else []),
             f"{'row':<18}{'floor':>9}{'eager':>9}{'t.compile':>10}{'kiln':>9}"
             f"{'kiln/floor':>11}{'kiln/tc':>8}{'kiln/eager':>11}{'tok/s':>9}{'max err':>9}"]
    for r in data["rows"]:
        ms = r["ms"]
        kiln = ms.get("kiln")

        toks = r["batch"] * (r["tokens"] if r["phase"] == "prefill" else 1)
        err = max(r["rel_err"].values(), default=None)
        lines.append(f"{r['key']:<18}{cell(r['floor_ms'], 9)}{cell(ms.get('eager'), 9)}"
                     f"{cell(ms.get('torch.compile'), 10)}{cell(kiln, 9)}"
                     f"{cell(kiln / r['floor_ms'] if kiln else None, 11, '.2f')}"
                     f"{cell(_ratio(kiln, ms.get('torch.compile')), 8, '.2f')}"
                     f"{cell(_ratio(kiln, ms.get('eager')), 11, '.2f')}"
                     f"{cell(toks / kiln * 1e3 if kiln else None, 9, '.0f')}"
                     f"{cell(err, 9, '.1e')}")
    bound = host_bound(data)
    if bound:
        lines.append(f"host-bound (the host's enqueue >= {HOST_BOUND:.0%} of the call: "
                     "faster kernels would not help): " + ", ".join(bound))
    capped = power_capped(data)
    if capped:
        lines.append("at the power cap (SW power cap in most samples, median SM MHz; the "
                     "floors' matmul runs in bursts at boost clocks): " + ", ".join(capped))
    ratios = quantized_ratios(data)
    if ratios:
        lines.append(f"kiln fp8 / {data['dtype']}: " + ", ".join(
            f"{key} {ratio:.2f}x" for key, ratio in ratios.items()))
    if any(r.get("quantize") and r["rel_err"] for r in data["rows"]):
        lines.append(FP8_ERR_NOTE)
    if data["compile_s"]:
        lines.append("first call (compile) s: " + ", ".join(
            f"{k} {v:.1f}" for k, v in data["compile_s"].items()))
    return "\n".join(lines)


HOST_BOUND = 0.9


def host_bound(data: dict) -> list[str]:
    """Each row and runner whose call's host enqueue time (GPUs) is at least HOST_BOUND
    of its time, e.g. "prefill 128 b1 kiln (host 6.1 of 6.4 ms)"."""
    out = []
    for r in data["rows"]:
        for name, host in (r.get("host_ms") or {}).items():
            ms = r["ms"].get(name)
            if ms and host >= HOST_BOUND * ms:
                out.append(f"{r['key']} {name} (host {host:.1f} of {ms:.1f} ms)")
    return out


def power_capped(data: dict) -> list[str]:
    """Each row and runner whose GPU sat at its power cap while timed (gpu_clock.py),
    e.g. "prefill 2048 b1 kiln (1450 MHz)"."""
    return [f"{r['key']} {name} ({state['sm_mhz']:.0f} MHz)" for r in data["rows"]
            for name, state in (r.get("gpu") or {}).items() if state["capped"] >= CAPPED]


def quantized_ratios(data: dict) -> dict[str, float]:
    """kiln's time on each quantised row over the same row of the model's dtype, keyed
    by the quantised row (issue 13's target: fp8 decode <= 0.6x fp16's)."""
    plain = {r["key"]: r["ms"].get("kiln") for r in data["rows"] if not r.get("quantize")}
    out = {}
    for r in data["rows"]:
        q = r.get("quantize")
        if not q:
            continue
        was, now = plain.get(r["key"].removesuffix(f" {q}")), r["ms"].get("kiln")
        if was and now:
            out[r["key"]] = now / was
    return out


def _measured(runs: list) -> str:
    """Where the floors came from, when measured more than once (older JSON: once)."""
    if len(runs) < 2:
        return ""
    copies = " / ".join(f"{m['copy_GBps']:.0f}" for m in runs)
    return f" (the faster of the start's and the end's: copy {copies} GB/s)"


def cell(value: float | None, width: int, fmt: str = ".3f") -> str:
    return f"{value:>{width}{fmt}}" if value is not None else f"{'-':>{width}}"


def _ratio(kiln: float | None, peer: float | None) -> float | None:
    return kiln / peer if kiln and peer else None


def write_chart(data: dict, path: Path) -> str | None:
    """A bar chart of each runner's time over the row's floor; None if no matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install matplotlib)"
    rows = data["rows"]
    names = [n for n in (*PEERS, "kiln") if any(n in r["ms"] for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j, r in enumerate(rows) if name in r["ms"]]
        ys = [r["ms"][name] / r["floor_ms"] for r in rows if name in r["ms"]]
        ax.bar(xs, ys, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, label="floor")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([r["key"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("time / floor (lower is better)")
    ax.set_title(f"{data['preset']} ({data['layers']} layers, {data['dtype']}) on "
                 f"{data['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def check(data: dict, baseline: dict, tolerance: float = 0.05) -> list[str]:
    """One line per kiln figure more than `tolerance` slower than the baseline's."""
    now = {r["key"]: r["ms"].get("kiln") for r in data["rows"]}
    slower = []
    for r in baseline.get("rows", []):
        was, key = r["ms"].get("kiln"), r["key"]
        if was is None or now.get(key) is None:
            continue
        if now[key] > was * (1 + tolerance):
            slower.append(f"{key}: kiln {now[key]:.3f} ms, baseline {was:.3f} ms "
                          f"({now[key] / was - 1:+.1%}, tolerance {tolerance:.0%})")
    return slower


def unchecked(data: dict, baseline: dict) -> list[str]:
    """This run's kiln rows the baseline has no kiln figure for (fp8 rows against a
    baseline measured without --quantize): reported, never a failure."""
    known = {r["key"] for r in baseline.get("rows", []) if r["ms"].get("kiln") is not None}
    return [r["key"] for r in data["rows"]
            if r["ms"].get("kiln") is not None and r["key"] not in known]


def save(data: dict, out: Path) -> list[str]:
    """bench.json, bench.txt and bench.png under `out`; returns notes for the user."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "bench.txt").write_text(table(data) + "\n")
    note = write_chart(data, out / "bench.png")
    return [note] if note else []
