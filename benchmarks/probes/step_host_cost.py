"""Probe: what a decode step costs beyond its CUDA graph (Qwen3-Next slice, batch 1).

The slice benchmark times LLM.forward with events around each call and a sync after
it, so the host work before the graph's first kernel (argument checks, the input
copies, the replay's launch) is in the figure; the profile's replay was ~40-50 us
shorter (0.431 vs 0.482 ms, RESULTS eleventh session). This times, in one process at
context 2048: the step as the benchmark does; the module called directly; the graph's
replay alone; 20 steps back to back (the host's work then overlaps the GPU's); and the
host's own time per call (perf_counter, the GPU kept busy). Run from the repo root:
PYTHONPATH=.:benchmarks python benchmarks/probes/step_host_cost.py [--tune none]"""

import argparse
import time

import torch

from kiln.bench.timing import back_to_back_ms, median_ms


def host_us(fn, n: int = 200) -> float:
    """Host microseconds a call takes to return (the queue kept non-empty)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tune", default="none")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--tiny", action="store_true",
                    help="kiln's tiny Llama (the host path is the same; compiles in seconds)")
    ap.add_argument("--cprofile", action="store_true", help="where LLM.forward's host time goes")
    a = ap.parse_args()
    from kiln.models.generate import LLM

    if a.tiny:
        from kiln.models.llama import tiny_llama

        model = tiny_llama(dtype=torch.bfloat16).cuda()
        cfg = model.cfg
        a.context = min(a.context, cfg.max_seq_len - 8)
    else:
        from qwen3_next_slice import slice_config

        from kiln.models.hf import random_model

        _, cfg = slice_config(False, a.context)
        model = random_model(cfg, torch.bfloat16, "cuda", seed=0)
    llm = LLM(model, target="cuda", max_batch_size=1, name="slice",
              compile_options={"tune": a.tune})
    T = a.context
    prompt = torch.randint(0, cfg.vocab_size, (1, T), device="cuda")
    ppos = torch.arange(T, device="cuda")
    tok = torch.randint(0, cfg.vocab_size, (1, 1), device="cuda")
    dpos = torch.full((1, 1), T, device="cuda")
    with torch.no_grad():
        llm.forward(prompt, ppos, logits_at=torch.full((1, 1), T - 1, device="cuda"))
        mod = llm.decode_module
        step = lambda: llm.forward(tok, dpos)  # noqa: E731
        call = lambda: mod(tokens=tok, input_pos=dpos)  # noqa: E731
        step()
        (cap,) = mod._graphs.graphs.values()
        rows = {
            "LLM.forward, synced (the benchmark)": median_ms(step, "cuda", 5, 100),
            "module call, synced": median_ms(call, "cuda", 5, 100),
            "graph replay alone, synced": median_ms(cap.graph.replay, "cuda", 5, 100),
            "LLM.forward, 20 back to back": back_to_back_ms(step, "cuda", reps=10),
            "graph replay, 20 back to back": back_to_back_ms(cap.graph.replay, "cuda", reps=10),
        }
        for name, ms in rows.items():
            print(f"{name:<40} {ms * 1e3:8.1f} us")
        print(f"{'host: LLM.forward returns after':<40} {host_us(step):8.1f} us")
        print(f"{'host: graph replay returns after':<40} {host_us(cap.graph.replay):8.1f} us")
        print(f"{'host: module call returns after':<40} {host_us(call):8.1f} us")
        flat = [tok, dpos]
        env = mod.program.bind(flat, mod.plan.user_inputs)
        pieces = {
            "flatten": lambda: mod._flatten((), {"tokens": tok, "input_pos": dpos}),
            "bind": lambda: mod.program.bind(flat, mod.plan.user_inputs),
            "input copies": lambda: [d.copy_(s) for d, s in zip(cap.inputs, flat)],
            "output clones": lambda: [o.clone() for o in cap.outputs],
            "GraphRunner.run": lambda: mod._graphs.run(flat, mod.state, env),
            "torch.cuda.is_available": torch.cuda.is_available,
        }
        for name, fn in pieces.items():
            print(f"{'host: ' + name:<40} {host_us(fn):8.1f} us")
        keys, mod._flat_kw = mod._flat_kw, None  # keywords through pytree, as before
        print(f"{'host: module call, pytree keywords':<40} {host_us(call):8.1f} us")
        print(f"{'LLM.forward synced, pytree keywords':<40} "
              f"{median_ms(step, 'cuda', 5, 100) * 1e3:8.1f} us")
        mod._flat_kw = keys
        if a.cprofile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                step()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
