"""How long lowering an LLM's captured prefill and decode programs to core ATen takes,
node by node (frontend/local_decompose.py, the default on torch >= 2.11) against
torch's whole-program re-trace, and whether both give one program (the same op
multiset and output specs). The model is built on the meta device and nothing is
compiled, so this runs in a minute on any machine:

    python benchmarks/decompose_time.py                      # Llama-3-8B shape
    python benchmarks/decompose_time.py --layers 4 --cache contiguous
    python benchmarks/decompose_time.py --preset qwen3-next-80b-a3b --layers 4
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections import Counter

import torch


def qwen3_next_80b_a3b(n_layers: int, max_seq_len: int):
    """Qwen3-Next-80B-A3B's shape (its config.json), cut to n_layers: three gated
    delta rule layers, then one of gated attention; every layer's MLP a 512-expert MoE."""
    from kiln.models.qwen3_next import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=151936, dim=2048, n_layers=n_layers,
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                          for i in range(n_layers)),
        n_heads=16, n_kv_heads=2, head_dim=256, rope_theta=10_000_000.0,
        linear_k_heads=16, linear_v_heads=32, linear_k_dim=128, linear_v_dim=128,
        intermediate_size=5120, n_experts=512, experts_per_token=10,
        moe_intermediate_size=512, shared_expert_intermediate_size=512,
        max_seq_len=max_seq_len)


def captured(args) -> dict:
    """{"prefill"|"decode": the ExportedProgram an LLM with these settings captures}."""
    from kiln.frontend import export
    from kiln.models.generate import generation_inputs
    from kiln.models.hf import DTYPES, build_model
    from kiln.models.llama import PRESETS

    if args.preset == "qwen3-next-80b-a3b":
        cfg = qwen3_next_80b_a3b(args.layers or 48, args.max_seq_len)
        args.cache = "contiguous"  # its linear-attention state is kept per cache row
    else:
        changes = {"max_seq_len": args.max_seq_len}
        if args.layers is not None:
            changes["n_layers"] = args.layers
        cfg = PRESETS[args.preset].with_(**changes)
    with torch.device("meta"):
        model = build_model(cfg).to(DTYPES[args.dtype])
    model.init_rope("meta")
    model.eval()
    paged = args.cache == "paged"
    model.setup_cache(max_batch_size=args.max_batch_size, paged=paged)
    out = {}
    for name, seq_len in (("prefill", None), ("decode", 1)):
        kwargs, shapes = generation_inputs(model, args.max_batch_size, seq_len, "meta", paged)
        t0 = time.perf_counter()
        out[name] = export.capture(model, (), kwargs, shapes)
        print(f"{name}: captured in {time.perf_counter() - t0:.2f} s")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3-8b",
                   help="a kiln.models.llama preset, or qwen3-next-80b-a3b")
    p.add_argument("--layers", type=int, default=None, help="default: the preset's")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--max-batch-size", type=int, default=4)
    p.add_argument("--cache", default="paged", choices=["paged", "contiguous"])
    args = p.parse_args()
    warnings.simplefilter("ignore", FutureWarning)

    from kiln.frontend import export
    from kiln.frontend.local_decompose import decompose_locally

    table = export.kiln_table()
    totals = {"local": 0.0, "retrace": 0.0, "local cpu": 0.0, "retrace cpu": 0.0}
    for name, ep in captured(args).items():
        # CPU seconds too: steadier than wall time on a machine other work shares
        t0, c0 = time.perf_counter(), time.process_time()
        local = decompose_locally(ep, table)
        t1, c1 = time.perf_counter(), time.process_time()
        ref = ep.run_decompositions(table)
        t2, c2 = time.perf_counter(), time.process_time()
        totals["local"] += t1 - t0
        totals["retrace"] += t2 - t1
        totals["local cpu"] += c1 - c0
        totals["retrace cpu"] += c2 - c1
        if local is None:
            print(f"{name}: node by node declined ({t1 - t0:.2f} s; torch "
                  f"{torch.__version__}, KILN_DECOMPOSE), re-trace {t2 - t1:.2f} s")
            continue
        same = (Counter(str(n.target) for n in local.graph.nodes)
                == Counter(str(n.target) for n in ref.graph.nodes)
                and [(s.kind, s.target) for s in local.graph_signature.output_specs]
                == [(s.kind, s.target) for s in ref.graph_signature.output_specs])
        print(f"{name}: node by node {t1 - t0:.2f} s ({c1 - c0:.2f} s CPU), re-trace "
              f"{t2 - t1:.2f} s ({c2 - c1:.2f} s CPU), {len(local.graph.nodes)} nodes, "
              f"same ops and outputs: {same}")
    print(f"both modules: node by node {totals['local']:.2f} s "
          f"({totals['local cpu']:.2f} s CPU), re-trace {totals['retrace']:.2f} s "
          f"({totals['retrace cpu']:.2f} s CPU)")


if __name__ == "__main__":
    main()
