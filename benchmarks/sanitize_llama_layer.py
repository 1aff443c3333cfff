"""kiln's generated kernels for one Llama-3-8B-shaped layer, to run under compute-sanitizer.

One decoder layer at the 8B widths (dim 4096, 32 heads, 8 KV heads, MLP 14336, the
LM head at vocab 128256) with random weights and a KV cache: a prefill of --prefill
tokens (prefill kernels: GEMMs, flash attention, fused norms and RoPE) then --decode
single-token steps (decode kernels: GEMV / split-K forms, attention against the
cache), for each dtype. Compiled with tuning off, so every region runs its generated
kernel, never a torch fallback that won a timing race. Each output is checked against
eager first, so a clean sanitizer run is also a correct one.

    python benchmarks/sanitize_llama_layer.py                    # warm kiln's cache
    compute-sanitizer --tool memcheck --kernel-name kns=kiln_ \\
        python benchmarks/sanitize_llama_layer.py                # then check it
    compute-sanitizer --tool racecheck --kernel-name kns=kiln_ python ...
"""

from __future__ import annotations

import argparse
import copy

import torch


def layer_model(dtype: torch.dtype, max_seq: int):
    from kiln.models.llama import PRESETS, Llama, LlamaConfig

    cfg = LlamaConfig(**{**PRESETS["llama3-8b"].__dict__, "n_layers": 1,
                         "max_seq_len": max_seq})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Llama(cfg).to(dtype).eval()
    for prm in model.parameters():
        torch.nn.init.normal_(prm, std=0.02)
    model.setup_cache(dtype)
    return model


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check_dtype(dtype: torch.dtype, prefill: int, decode: int, eager_check: bool = True,
                ) -> list[str]:
    import kiln

    model = layer_model(dtype, prefill + decode + 8)
    vocab = model.cfg.vocab_size
    T = torch.export.Dim("seq", min=1, max=model.cfg.max_seq_len)
    ex = (torch.randint(0, vocab, (1, 16), device="cuda"), torch.arange(16, device="cuda"))
    opts = {"tune": "none"}
    pre = kiln.compile(model, ex, dynamic_shapes=({1: T}, {0: T}), target="cuda", options=opts)
    dec = kiln.compile(model, (ex[0][:, :1], ex[1][:1]), target="cuda", options=opts)
    eager = copy.deepcopy(model)  # its own KV cache
    lines = []
    for name, exe in (("prefill", pre), ("decode", dec)):
        kinds: dict[str, int] = {}
        for k in exe.program.kplan.kernels.values():
            kinds[k.kind] = kinds.get(k.kind, 0) + 1
        lines.append(f"{dtype} {name}: kernels {kinds}")
    prompt = torch.randint(0, vocab, (1, prefill), device="cuda")
    with torch.no_grad():
        out = pre(prompt, torch.arange(prefill, device="cuda"))
        ref = eager(prompt, torch.arange(prefill, device="cuda")) if eager_check else out
    lines.append(f"{dtype} prefill {prefill}: rel err vs eager {rel_err(out, ref):.2e}")
    for step in range(decode):
        tok = torch.randint(0, vocab, (1, 1), device="cuda")
        pos = torch.tensor([prefill + step], device="cuda")
        with torch.no_grad():
            out = dec(tok, pos)
            ref = eager(tok, pos) if eager_check else out
        lines.append(f"{dtype} decode at {prefill + step}: rel err vs eager "
                     f"{rel_err(out, ref):.2e}")
    torch.cuda.synchronize()
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", default="float16,bfloat16")
    p.add_argument("--prefill", type=int, default=100)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--no-eager", action="store_true",
                   help="skip the eager comparison (racecheck trips over cuBLAS's kernels)")
    a = p.parse_args()
    for name in a.dtypes.split(","):
        for line in check_dtype(getattr(torch, name), a.prefill, a.decode, not a.no_eager):
            print(line, flush=True)


if __name__ == "__main__":
    main()
