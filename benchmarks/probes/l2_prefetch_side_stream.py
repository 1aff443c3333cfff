"""Probe: can a decode step's idle HBM time stream the next GEMV's weights into L2 (issue
10, issue 14)? Between a layer's GEMVs sit latency-bound kernels (the K/V write and
attention in a Llama layer, ~9 us of an 8B layer's ~124 us; the gated delta step, topk
and norms in Qwen3-Next's) that move almost no bytes. The sixth session prefetched from
inside the next GEMV (PDL, before its wait) and lost: the early blocks held SM slots.
Here the prefetch is a separate small kernel on a second stream of the same CUDA graph,
forked after the GEMV before the idle stretch and joined at the graph's end, so no
kernel of the main chain waits on it or on its blocks.

Each "layer" is the 8B's decode shape: wqkv GEMV, an idle stretch (`busy`: a few
programs walking a dependent chain of L2 loads), wo, w13, w2 GEMVs (distinct weights a
layer, 8 layers: ~3.5 GB, far past L2). Variants: no prefetch; the first X MB of wo
prefetched during the idle stretch by P programs, with `cp.async.bulk.prefetch.L2` (one
instruction per chunk) or `prefetch.global.L2` (one per 128-byte line), on the second
stream ("-join": wo waits for it) or ("bulk-main") in the chain itself before the idle
stretch; and the GEMV wo alone from a cold L2 and from a warm one (a graph of the
prefetch, the idle stretch and wo, whose 33.5 MB stay in L2 from replay to replay: what
a prefetch could reach at best, not what this one does). Per-layer us, median of graph
replays.

GPU: PYTHONPATH=.:benchmarks/probes python benchmarks/probes/l2_prefetch_side_stream.py
     [--busy 12 24] [--mb 8 16 32] [--programs 8 32] [--forms bulk lines]
"""
import argparse
import json
import os

import torch
import triton
import triton.language as tl
from gemv_forms import copy_gbps, graph_us
from gemv_pdl_overlap import gemv

LAYERS = 8
REPS = 15  # graph replays a figure (median)
SHAPES = {"wqkv": (6144, 4096), "wo": (4096, 4096), "w13": (28672, 4096), "w2": (4096, 14336)}


@triton.jit
def busy(chain_ptr, out_ptr, ITERS: tl.constexpr):
    """A latency-bound stand-in for attention: each program walks a dependent chain of
    loads through a small (L2-resident) table."""
    pid = tl.program_id(0)
    i = pid
    for _ in range(ITERS):
        i = tl.load(chain_ptr + i)
    tl.store(out_ptr + pid, i)


@triton.jit
def prefetch_bulk(base_ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Each lane asks L2 for one CHUNK-byte piece: `cp.async.bulk.prefetch.L2`."""
    pid = tl.program_id(0)
    piece = pid * LANES + tl.arange(0, LANES)
    off = piece.to(tl.int64) * CHUNK
    ok = off < nbytes
    addr = tl.where(ok, base_ptr.to(tl.int64, bitcast=True) + off, 0)
    size = tl.where(ok, tl.minimum(nbytes - off, CHUNK), 0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_lines(base_ptr, nbytes, LINES: tl.constexpr):
    """Each lane asks L2 for 128-byte lines, LINES lanes a program a step."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * LINES
    first = pid * LINES + tl.arange(0, LINES)
    for line0 in range(0, tl.cdiv(nbytes, 128), step):
        off = (line0 + first).to(tl.int64) * 128
        ok = off < nbytes
        addr = tl.where(ok, base_ptr.to(tl.int64, bitcast=True) + off, 0)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s64 p, $1, 0; @p prefetch.global.L2 [$1]; "
            "mov.u32 $0, 0; }", "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)


class Chain:
    def __init__(self, busy_iters: int):
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.w = [{n: torch.randn(*SHAPES[n], device="cuda", dtype=torch.float16) * 0.02
                   for n in SHAPES} for _ in range(LAYERS)]
        self.x = {K: torch.randn(K, device="cuda", dtype=torch.float16) for K in (4096, 14336)}
        self.o = torch.empty(28672, device="cuda", dtype=torch.float16)
        self.scratch = torch.empty(64 << 20, device="cuda", dtype=torch.float32)
        self.lock = torch.zeros(1 << 16, device="cuda", dtype=torch.int32)
        n = 1 << 14
        self.table = torch.randperm(n, device="cuda", dtype=torch.int32)
        self.sink = torch.empty(1024, device="cuda", dtype=torch.int32)
        self.busy_iters = busy_iters
        self.side = torch.cuda.Stream()

    def gemv(self, name: str, layer: int):
        N, K = SHAPES[name]
        bn, bk = 64, 128
        s = max(1, min(16, (4 * self.sms) // triton.cdiv(N, bn), triton.cdiv(K, bk)))
        gemv[(triton.cdiv(N, bn), 1, s)](self.w[layer][name], self.x[K], self.o,
                                          self.scratch, self.lock, N, K, bn, bk, 16, 0, 0, 0,
                                          num_warps=4, num_stages=1)

    def idle(self):
        busy[(64,)](self.table, self.sink, self.busy_iters, num_warps=1)

    def prefetch(self, t: torch.Tensor, mb: float, form: str, programs: int):
        nbytes = min(t.numel() * t.element_size(), int(mb * (1 << 20)))
        if form == "bulk":
            lanes = 32
            chunk = max(4096, triton.next_power_of_2(triton.cdiv(nbytes, programs * lanes)))
            chunk = min(chunk, 1 << 20)
            grid = triton.cdiv(nbytes, chunk * lanes)
            prefetch_bulk[(grid,)](t, nbytes, chunk, lanes, num_warps=1)
        else:
            prefetch_lines[(programs,)](t, nbytes, 128, num_warps=4)

    def layers(self, mb: float = 0.0, form: str = "bulk", programs: int = 16):
        main = torch.cuda.current_stream()
        for i in range(LAYERS):
            self.gemv("wqkv", i)
            if mb and form.endswith("-main"):  # in the chain: it only issues the requests
                self.prefetch(self.w[i]["wo"], mb, form[:-5], programs)
            elif mb:
                self.side.wait_stream(main)
                with torch.cuda.stream(self.side):
                    self.prefetch(self.w[i]["wo"], mb, form.removesuffix("-join"), programs)
            self.idle()
            if mb and form.endswith("-join"):  # wo waits for the prefetch to finish
                main.wait_stream(self.side)
            self.gemv("wo", i)
            self.gemv("w13", i)
            self.gemv("w2", i)
        if mb and not form.endswith("-main"):
            main.wait_stream(self.side)


def measure(c: Chain, bw: float, a) -> dict:
    """One busy length's rows: the chain without and with each prefetch, wo alone."""
    layer_bytes = sum(n * k * 2 for n, k in SHAPES.values())
    floor = layer_bytes / (bw * 1e9) * 1e6
    idle = graph_us(lambda: [c.idle() for _ in range(20)], 20, REPS)
    base = graph_us(c.layers, LAYERS, REPS)
    print(f"-- busy {c.busy_iters} steps: idle stretch {idle:.2f} us; layer floor {floor:.2f} "
          f"us; no prefetch {base:.2f} us a layer")
    rows = {"idle_us": idle, "floor_us": floor, "none": base}
    for form in a.forms:
        for mb in a.mb:
            for programs in a.programs:
                t = graph_us(lambda m=mb, f=form, p=programs: c.layers(m, f, p), LAYERS, REPS)
                rows[f"{form} {mb} MB {programs} progs"] = t
                print(f"   {form:5s} {mb:4.1f} MB of wo, {programs:2d} programs: {t:.2f} us "
                      f"({t - base:+.2f})")
    # wo alone, L2 cold (after a 256 MB sweep) and warm (its graph's footprint stays in L2)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wo = c.w[0]["wo"]

    def wo_cold():
        flush.zero_()
        c.gemv("wo", 0)

    def hot_parts():
        c.prefetch(wo, 64, "bulk", 32)
        c.idle()

    def wo_hot():
        hot_parts()
        c.gemv("wo", 0)

    cold = graph_us(wo_cold, 1, REPS) - graph_us(flush.zero_, 1, REPS)
    hot = graph_us(wo_hot, 1, REPS) - graph_us(hot_parts, 1, REPS)
    rows.update(wo_cold_us=cold, wo_hot_us=hot)
    print(f"   wo alone: cold L2 {cold:.2f} us, warm L2 {hot:.2f} us")
    ref = c.w[0]["w2"].float() @ c.x[14336].float()
    c.gemv("w2", 0)
    torch.cuda.synchronize()
    err = ((c.o[:4096].float() - ref).norm() / ref.norm()).item()
    print(f"   gemv check: rel err {err:.1e}")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--busy", type=int, nargs="+", default=[12, 24])
    ap.add_argument("--mb", type=float, nargs="+", default=[8, 16, 32])
    ap.add_argument("--programs", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--forms", nargs="+", default=["bulk", "lines"])
    a = ap.parse_args()
    bw = copy_gbps()
    results = {"copy_gbs": bw}
    print(f"copy {bw:.0f} GB/s")
    for iters in a.busy:
        results[f"busy{iters}"] = measure(Chain(iters), bw, a)
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "l2_prefetch_side_stream.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
