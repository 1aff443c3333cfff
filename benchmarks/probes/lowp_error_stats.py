"""Probe: is kiln's fp16 / bf16 error against fp32 above transformers' own at that dtype?
(tests/models/test_models_gpu.py's rule asks each run to be no worse than eager's.)

Per tiny HF family (tests/models/support.py's checkpoints) and dtype: `--sets` random
20-token sets, each a 13-token prefill then 7 decode steps on kiln's LLM (target cuda),
transformers' model in the same dtype on the same GPU, and transformers in fp32 on the
CPU (the reference). Prints per family and dtype the mean and max relative error of
kiln and of eager against fp32 (each position's logits), the median and 90th
percentile of kiln/eager, and how many positions a per-position 1.5x rule would fail.
Findings: benchmarks/RESULTS.md "2026-11-29, tenth session".

GPU: PYTHONPATH=. python benchmarks/probes/lowp_error_stats.py [--families qwen2,mistral]
     [--sets 12]
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import tempfile

import torch

import kiln.models
from tests.helpers import rel_err
from tests.models.support import FAMILIES, make_checkpoint


def stats(llm, hf, dtype, sets: int) -> str:
    low = copy.deepcopy(hf).to("cuda", dtype)
    ratios, kerr, eerr, fails = [], [], [], 0
    for seed in range(sets):
        tokens = torch.randint(3, llm.cfg.vocab_size, (1, 20),
                               generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            ref = hf(tokens).logits
            eager = low(tokens.cuda()).logits.float().cpu()
        out = [llm.forward(tokens[:, :13], torch.arange(13))]
        out += [llm.forward(tokens[:, p:p + 1], torch.tensor([p])) for p in range(13, 20)]
        out = torch.cat(out, 1).float().cpu()
        for p in range(20):
            k, e = rel_err(out[:, p], ref[:, p]), rel_err(eager[:, p], ref[:, p])
            kerr.append(k)
            eerr.append(e)
            ratios.append(k / e)
            fails += rel_err(out[:, p], eager[:, p]) > 1e-2 and k > max(1e-2, 1.5 * e)
    r = torch.tensor(ratios)
    return (f"kiln err mean {sum(kerr) / len(kerr):.2e} max {max(kerr):.2e} | eager mean "
            f"{sum(eerr) / len(eerr):.2e} max {max(eerr):.2e} | ratio median {r.median():.2f} "
            f"p90 {r.quantile(0.9):.2f} | 1.5x-rule failures {fails}/{len(ratios)}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--sets", type=int, default=12)
    a = ap.parse_args(argv)
    root = pathlib.Path(tempfile.mkdtemp())
    for family in a.families.split(","):
        hf = make_checkpoint(root / family, family)
        for dtype in (torch.float16, torch.bfloat16):
            llm = kiln.models.load(root / family, dtype=dtype, target="cuda", max_batch_size=3)
            print(f"{family:9s} {str(dtype)[6:]:9s} {stats(llm, hf, dtype, a.sets)}", flush=True)


if __name__ == "__main__":
    main()
