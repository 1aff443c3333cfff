"""Probe: which K-loop form brings the block-scaled fp8 GEMM (prefill, M >= 512) nearer
torch._scaled_mm rowwise (issue 13's target: >= 0.9x; kiln's template ran 0.6-0.75x).
Hand-written Triton kernels of kiln's form (templates/fp8_matmul/gemm.py: BK 128, one
scale pair a step, each block's product promoted into fp32 with its scales), differing
only in how the tiles reach shared memory and how programs walk the tiles:

  ptr        pointer loads (cp.async, `num_stages` deep): kiln's template today
  ptr_T      the same with x's scales stored K-major ([KB, M]: one contiguous load a step)
  ptr_delay  the previous block promoted after this block's wgmma is issued (Triton
             still waits for each wgmma at once: its pipeliner keeps a dot in flight only
             when its result is the next dot's accumulator)
  tma        TMA loads from descriptors made on the host (TensorDescriptor arguments)
  dtma       TMA loads from descriptors the kernel makes (tl.make_tensor_descriptor: a
             global scratch per program, triton.set_allocator)
  pers_*     persistent: SMs x occupancy programs walk the tiles, the tile and K loops
             flattened so loads run ahead across tile boundaries; host (pers_host) or
             device (pers_dev) descriptors; pers_ws adds Triton's warp specialisation
             (a load partition; on sm_90 it specialises 4-warp tiles only)

Every form is checked against the op in fp32 (relative error) and timed from replayed
CUDA graphs (triton's do_bench_cudagraph, L2 warm) beside torch._scaled_mm rowwise on
the same fp8 operands (the GEMM alone). Ratio = _scaled_mm's time / the form's.
Findings: benchmarks/RESULTS.md "2026-11-29, tenth session".

GPU: PYTHONPATH=. python benchmarks/probes/fp8_gemm_forms.py --out f.json
     [--m 2048,512] [--shapes q_a,o] [--forms ptr,tma] [--configs small]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton
import triton.language as tl

SHAPES = {"q_a": (1536, 7168), "kv_a": (576, 7168), "o": (7168, 16384),
          "sh_gu": (2048, 7168), "sh_down": (7168, 2048), "l_qo": (4096, 4096),
          "l_gu": (14336, 4096), "l_down": (4096, 14336)}
FORMS = ("ptr", "ptr_T", "ptr_delay", "tma", "dtma", "pers_host", "pers_host2", "pers_dev",
         "pers_dev2", "pers_ws")
# (BM, BN, warps, stages); BN <= 128: one weight scale a tile (the tma form takes 256 too)
CONFIGS = [(128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 3), (64, 128, 4, 4),
           (64, 128, 4, 5), (128, 64, 4, 4), (128, 128, 4, 3)]
# 256-column tiles: two warp groups share each x tile (tma form only)
WIDE = [(64, 128, 4, 3), (64, 256, 8, 3), (64, 256, 8, 4), (128, 256, 8, 3), (128, 128, 8, 3)]
SMALL = [(128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 4, 3)]


@triton.jit
def _tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    tiles_n = tl.cdiv(N, BN)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(tl.cdiv(M, BM) - first_m, GROUP_M)
    return first_m + (pid % in_group) % group_m, (pid % in_group) // group_m


@triton.jit
def gemm_ptr(xq, xs, w, ws, out, M, N, K, KB, XS_M, XS_K,
             BM: tl.constexpr, BN: tl.constexpr, DELAY: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, 128)
    a_ptrs = xq + (rm % M)[:, None] * K + rk[None, :]
    b_ptrs = w + (rn % N)[None, :] * K + rk[:, None]
    as_ptrs = xs + (rm % M) * XS_M
    bs_ptrs = ws + (pid_n * BN // 128) * KB
    acc = tl.zeros([BM, BN], tl.float32)
    if DELAY:
        prev = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), out_dtype=tl.float32)
        s_prev = tl.load(as_ptrs) * tl.load(bs_ptrs)
        for kb in range(1, KB):
            s = tl.load(as_ptrs + kb * XS_K) * tl.load(bs_ptrs + kb)
            cur = tl.dot(tl.load(a_ptrs + kb * 128), tl.load(b_ptrs + kb * 128),
                         out_dtype=tl.float32)
            acc += prev * s_prev[:, None]
            prev = cur
            s_prev = s
        acc += prev * s_prev[:, None]
    else:
        for kb in range(0, KB):
            a = tl.load(a_ptrs + kb * 128)
            b = tl.load(b_ptrs + kb * 128)
            scale = tl.load(as_ptrs + kb * XS_K) * tl.load(bs_ptrs + kb)
            acc += tl.dot(a, b, out_dtype=tl.float32) * scale[:, None]
    om, on = rm[:, None], rn[None, :]
    tl.store(out + om * N + on, acc.to(tl.bfloat16), mask=(om < M) & (on < N))


@triton.jit
def gemm_tma(xq, a_desc, xs, w, b_desc, ws, out, M, N, K, KB, XS_M, XS_K,
             BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
             DEVICE_DESC: tl.constexpr):
    if DEVICE_DESC:
        a_desc = tl.make_tensor_descriptor(xq, [M, K], [K, 1], [BM, 128])
        b_desc = tl.make_tensor_descriptor(w, [N, K], [K, 1], [BN, 128])
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    off_m, off_n = pid_m * BM, pid_n * BN
    rm = off_m + tl.arange(0, BM)
    as_ptrs = xs + (rm % M) * XS_M
    if BN <= 128:  # one weight block a tile: one scale a step
        bs_ptrs = ws + (off_n // 128) * KB
    else:  # a scale per column
        bs_ptrs = ws + (((off_n + tl.arange(0, BN)) % N) // 128) * KB
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, KB):
        a = a_desc.load([off_m, kb * 128])
        b = b_desc.load([off_n, kb * 128])
        if BN <= 128:
            scale = tl.load(as_ptrs + kb * XS_K) * tl.load(bs_ptrs + kb)
            acc += tl.dot(a, b.T, out_dtype=tl.float32) * scale[:, None]
        else:
            a_s = tl.load(as_ptrs + kb * XS_K)
            b_s = tl.load(bs_ptrs + kb)
            acc += tl.dot(a, b.T, out_dtype=tl.float32) * (a_s[:, None] * b_s[None, :])
    om, on = rm[:, None], (off_n + tl.arange(0, BN))[None, :]
    tl.store(out + om * N + on, acc.to(tl.bfloat16), mask=(om < M) & (on < N))


@triton.jit
def gemm_pers(xq, a_desc, xs, w, b_desc, ws, out, M, N, K, KB, XS_M, XS_K,
              BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
              DEVICE_DESC: tl.constexpr, STAGES: tl.constexpr, WS: tl.constexpr,
              PROGRAMS: tl.constexpr):
    if DEVICE_DESC:
        a_desc = tl.make_tensor_descriptor(xq, [M, K], [K, 1], [BM, 128])
        b_desc = tl.make_tensor_descriptor(w, [N, K], [K, 1], [BN, 128])
    start = tl.program_id(0)
    num_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    steps = (num_tiles // PROGRAMS + (start < num_tiles % PROGRAMS)) * KB
    tile = start - PROGRAMS
    kb = -1
    off_m = 0
    off_n = 0
    acc = tl.zeros([BM, BN], tl.float32)
    as_ptrs = xs + tl.zeros([BM], tl.int32)
    bs_ptrs = ws
    for _ in tl.range(0, steps, num_stages=STAGES, warp_specialize=WS):
        kb = tl.where(kb == KB - 1, 0, kb + 1)
        if kb == 0:
            tile += PROGRAMS
            pid_m, pid_n = _tile(tile, M, N, BM, BN, GROUP_M)
            off_m, off_n = pid_m * BM, pid_n * BN
            as_ptrs = xs + ((off_m + tl.arange(0, BM)) % M) * XS_M
            bs_ptrs = ws + (off_n // 128) * KB
        a = a_desc.load([off_m, kb * 128])
        b = b_desc.load([off_n, kb * 128])
        scale = tl.load(as_ptrs + kb * XS_K) * tl.load(bs_ptrs + kb)
        acc += tl.dot(a, b.T, out_dtype=tl.float32) * scale[:, None]
        if kb == KB - 1:
            om = (off_m + tl.arange(0, BM))[:, None]
            on = (off_n + tl.arange(0, BN))[None, :]
            tl.store(out + om * N + on, acc.to(tl.bfloat16), mask=(om < M) & (on < N))
            acc = tl.zeros([BM, BN], tl.float32)


def operands(M: int, N: int, K: int, device):
    """x quantised per token and 128-block, w per 128 x 128 block (e4m3), and the op's
    value from the dequantised operands in fp32."""
    KB, NB = K // 128, -(-N // 128)
    x = torch.randn(M, K, device=device).view(M, KB, 128)
    xs = x.abs().amax(-1).clamp(min=1e-4) / 448.0
    xq = (x / xs[..., None]).to(torch.float8_e4m3fn).view(M, K)
    w = torch.zeros(NB * 128, K, device=device)
    w[:N] = torch.randn(N, K, device=device) * 0.05
    blocks = w.view(NB, 128, KB, 128)
    ws = blocks.abs().amax((1, 3)).clamp(min=1e-6) / 448.0
    wq = (blocks / ws[:, None, :, None]).to(torch.float8_e4m3fn).view(NB * 128, K)[:N]
    wq = wq.contiguous()
    ref = ((xq.float().view(M, KB, 128) * xs[..., None]).view(M, K)
           @ (wq.float().view(N, KB, 128) * ws.repeat_interleave(128, 0)[:N, :, None])
           .view(N, K).t())
    return xq, xs, wq, ws, ref


def launcher(form: str, cfg, xq, xs, wq, ws, out, sms: int):
    """A no-argument call of `form` at `cfg` = (BM, BN, warps, stages)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, nw, st = cfg
    (M, K), N = xq.shape, wq.shape[0]
    KB = K // 128
    xs_used, xs_m, xs_k = (xs.t().contiguous(), 1, M) if form == "ptr_T" else (xs, KB, 1)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    common = dict(BM=bm, BN=bn, GROUP_M=8, num_warps=nw, num_stages=st)
    args = (M, N, K, KB, xs_m, xs_k)
    if form.startswith("ptr"):
        return lambda: gemm_ptr[(tiles,)](xq, xs_used, wq, ws, out, *args,
                                          DELAY=int(form == "ptr_delay"), **common)
    ad = TensorDescriptor.from_tensor(xq, [bm, 128])
    bd = TensorDescriptor.from_tensor(wq, [bn, 128])
    if form in ("tma", "dtma"):
        return lambda: gemm_tma[(tiles,)](xq, ad, xs, wq, bd, ws, out, *args,
                                          DEVICE_DESC=int(form == "dtma"), **common)
    programs = min(sms * (2 if form.endswith("2") else 1), tiles)
    return lambda: gemm_pers[(programs,)](
        xq, ad, xs, wq, bd, ws, out, *args, DEVICE_DESC=int(not form.startswith("pers_host")),
        STAGES=st, WS=int(form == "pers_ws"), PROGRAMS=programs, **common)


def bench(fn) -> float:
    """Milliseconds of fn from replayed CUDA graphs (L2 warm)."""
    from triton.testing import do_bench_cudagraph

    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=60)


def reference_row(M: int, name: str, rows: list) -> tuple:
    """The shape's operands (seeded), torch._scaled_mm rowwise timed on them and recorded
    in `rows`: (xq, xs, wq, ws, the op's value, _scaled_mm's ms, flops, an output)."""
    N, K = SHAPES[name]
    torch.manual_seed(0)
    xq, xs, wq, ws, ref = operands(M, N, K, "cuda")
    sa, sb = torch.rand(M, 1, device="cuda") + 0.5, torch.rand(1, N, device="cuda") + 0.5
    t_ref = bench(functools.partial(torch._scaled_mm, xq, wq.t(), scale_a=sa, scale_b=sb,
                                    out_dtype=torch.bfloat16))
    flops = 2 * M * N * K
    rows.append({"M": M, "shape": name, "form": "scaled_mm_rowwise", "ms": t_ref,
                 "tflops": flops / t_ref / 1e9})
    print(f"M {M} {name} N {N} K {K}: _scaled_mm rowwise {t_ref * 1e3:.1f} us "
          f"{flops / t_ref / 1e9:.0f} TF/s", flush=True)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    return xq, xs, wq, ws, ref, t_ref, flops, out


def run(ms, shapes, forms, configs) -> list[dict]:
    triton.set_allocator(lambda size, align, stream:
                         torch.empty(size, dtype=torch.int8, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for M in ms:
        for name in shapes:
            xq, xs, wq, ws, ref, t_ref, flops, out = reference_row(M, name, rows)
            for form in forms:
                best = None
                for cfg in configs:
                    if form == "pers_ws" and cfg[2] != 4:
                        continue
                    try:
                        fn = launcher(form, cfg, xq, xs, wq, ws, out, sms)
                        out.zero_()
                        fn()
                        torch.cuda.synchronize()
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        t = bench(fn)
                    except Exception as e:  # a form this Triton cannot build
                        print(f"   {form} {cfg}: FAIL {str(e)[:120]}", flush=True)
                        continue
                    r = {"M": M, "shape": name, "form": form, "cfg": list(cfg), "ms": t,
                         "tflops": flops / t / 1e9, "vs_rowwise": t_ref / t, "err": err}
                    rows.append(r)
                    if best is None or t < best["ms"]:
                        best = r
                if best:
                    print(f"   {form:10s} best {best['cfg']} {best['ms'] * 1e3:.1f} us "
                          f"{best['tflops']:.0f} TF/s ratio {best['vs_rowwise']:.2f} "
                          f"err {best['err']:.1e}", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fp8_gemm_forms.json")
    ap.add_argument("--m", default="2048")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--configs", choices=["all", "small", "wide"], default="all")
    a = ap.parse_args(argv)
    rows = run([int(m) for m in a.m.split(",")], a.shapes.split(","), a.forms.split(","),
               {"small": SMALL, "wide": WIDE}.get(a.configs, CONFIGS))
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
