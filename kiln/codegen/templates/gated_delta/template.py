"""The gated delta rule template: one Triton kernel for a region holding kiln::gated_delta_rule.

The op (kiln.ops.gated_delta_rule) is an extern op: torch.export keeps it whole and on
the CPU it runs as its chunked PyTorch form. On Triton targets this template generates
its kernel instead; one launch covers the whole op, so it fits one KernelSpec.

A sequence is cut into chunks of CHUNK steps (a tunable; a tail shorter than CHUNK is
masked). The work splits in kinds of programs of one launch, told apart by tickets
(launch.chunked_body):

- preparers, one per (sequence, chunk, value head), all in parallel (body.prep): the
  gate's cumulative sum G, A = beta k k^T exp(G_i - G_j) (strictly lower), (I + A)^-1
  by doubling products, W = (I + A)^-1 (beta exp(G) k), U0 = (I + A)^-1 (beta v) and
  the causal scores exp(G_i - G_j) q.k (scaled), stored to scratch;
- walkers, one per (sequence, value head, BV value columns), keep the [K, BV] fp32
  state block in registers and walk the chunks in order once every chunk is prepared:
  U = U0 - W S and S = exp(G_C) S + (exp(G_C - G) k)^T U. Two forms (the tunable
  STAGED; both are candidates, the tuner times them):
  - one-pass (STAGED = 0, body.walk): the walker also writes the outputs,
    o = exp(G) q S + scores U, so no state leaves the registers, but four products a
    chunk sit on the sequential path;
  - staged (STAGED = 1, staged.py), as flash-linear-attention's kernels in spirit: the
    walker does only the state's two products, stores each chunk's state h (q's dtype)
    and U to scratch and counts the chunk on a flag; output programs, one per (chunk,
    sequence, value head, BV columns), compute o = exp(G) scale q h + scores U in
    parallel, each as soon as its walker has passed its chunk. Chunks of 32 or 64
    steps only: the stored states cost K V bytes per chunk.

flash-linear-attention runs these stages as separate kernels; here they share one
launch (a KernelSpec is one launch, and tickets order them as split_k.py's arrival
counters do), so the outputs overlap the walk and no launch waits for the last
program of the one before. The price: one register allocation for all roles, so the
heaviest role (the preparer at 64-step chunks) sets how many programs share an SM. A
static one-step op (decode) needs none of it: its programs (one per value head and BV
columns) take the recurrence directly, S = S exp(g); u = beta (v - S^T k);
S += k u^T; o = S^T (scale q); and they compute what dispatch folded into the step's
region: its operands' producers, a norm of o over each value head (run by the last
program of a head to finish when BV < V: body.py) and the state's in-place write
(step_fusion.py).

q, k, v, g, beta and the initial state are read through the region's fused views by the
expression emitter (a q that is a slice of a projection is read in place); cu_seqlens
(packed sequences) gives each program its sequence's bounds. Value head j reads key
head j // (HV // H). 16-bit operands stay 16-bit for tl.dot (fp32 accumulation; the
solve's products in tf32); fp32 inputs multiply in IEEE fp32. The configs span CHUNK,
BV, the form, num_warps 4, 8 and 16 (the warps that once crashed Triton's compiler on
flash-linear-attention's kernel: the autotuner quarantines such a config and tunes the
rest) and 1 or 2 pipeline stages for the walk.
"""

from __future__ import annotations

import torch

from kiln.codegen.build.spec import Config, KernelSpec, Scratch
from kiln.codegen.expr.emit import Emitter, kernel_name, module_source
from kiln.codegen.expr.kernel_args import SymbolicArgs
from kiln.codegen.expr.values import CodegenUnsupported
from kiln.codegen.expr.views import is_view
from kiln.codegen.templates.gated_delta import staged
from kiln.codegen.templates.gated_delta.analysis import OP, DeltaShape, analyse, pow2
from kiln.codegen.templates.gated_delta.body import EPILOGUE, SCRATCH, decode_body
from kiln.codegen.templates.gated_delta.launch import chunked_body
from kiln.ir.plan import DispatchPlan, Ref, Region
from kiln.ir.symbolic import bounds_of
from kiln.target import Target

__all__ = ["OP", "config_space", "generate", "heuristic"]

CHUNKS = (64, 32, 16)
VALUE_BLOCKS = (64, 32, 16)
# the staged walkers' value blocks: the three widest that fit V and keep the state block
# within 64 KiB (K = 256 by 128 columns spilled 172 registers on 16 warps, sm_90): few
# walkers, as they hold their SMs for the whole walk
STAGED_VALUE_BLOCKS = (128, 64, 32, 16)
STATE_BLOCK_MAX = 256 * 64
WARPS = (4, 8, 16)
STAGES = (1, 2)


def config_space(shape: DeltaShape) -> list[Config]:
    """Both forms (STAGED 1 first, then the one-pass form), each over chunk sizes, value
    blocks, warps and the walk's pipeline stages, largest work per program first. The
    staged form stores a state per chunk, so it takes chunks of 32 steps or more (16
    would write four times the bytes of 64), and only where T may exceed one chunk. A
    static one-step op has no chunks: its configs differ only in BV and warps."""
    vp = pow2(shape.value_dim)
    blocks = [b for b in VALUE_BLOCKS if b <= vp] or [16]
    t_hi = shape.static_t
    if t_hi == 1:
        if shape.epilogue:  # a reduction over each value head: whole heads a program,
            blocks = sorted({vp, *blocks}, reverse=True)  # or the last to arrive (body.py)
        return [Config.make(w, 1, CHUNK=16, BV=bv) for bv in blocks for w in WARPS]
    chunks = [c for c in CHUNKS if t_hi is None or c <= pow2(t_hi)]
    if shape.dtype == torch.float32:  # exact fp32 dots run on FMA units: 64-step chunks
        chunks = [c for c in chunks if c <= 32]  # took 95 s to compile and spilled
    staged_chunks = [c for c in chunks if c >= 32 and (t_hi is None or t_hi > c)]
    kp = pow2(shape.key_dim)
    staged_blocks = [b for b in STAGED_VALUE_BLOCKS
                     if b <= vp and kp * b <= STATE_BLOCK_MAX][:3] or [16]
    return [Config.make(w, st, CHUNK=c, BV=bv, STAGED=form)
            for form, cs, bvs in ((1, staged_chunks, staged_blocks), (0, chunks, blocks))
            for c in cs for bv in bvs
            for w in WARPS for st in STAGES
            if not (_faults_staged(shape, bv, w) if form else _spills_badly(shape, c, w))]


def _faults_staged(shape: DeltaShape, bv: int, warps: int) -> bool:
    """The staged form's 16-bit dots on 8 or more warps with value blocks of 32 or fewer:
    at K = V = 128 in bf16 (64-step chunks, BV 32, 8 warps, two stages; no register
    spilled on sm_90) it faulted with an illegal address on an H200, with and without
    the twenty-second session's walker (tests/codegen/test_gated_delta_gpu.py), while
    the interpret target, 4 warps at BV 32 and 8 warps at BV 64 ran right (fp32's FMA
    dots on 8 warps at BV 32 are Qwen3-Next's default and run). Located since
    (benchmarks/probes/gated_delta_fault.py, H200): at 64-step chunks every such config
    is wrong, the same source right on 4 warps: STAGED 1 on 8 / 16 warps at BV 32 and
    on 8 at BV 16 gave outputs 15x further from fp64 (o 4.0e-2 against 2.7e-3; the
    state right), and a form since removed (one output program over every value block)
    on 8 warps at BV 32 made an out-of-bounds 512-byte shared-memory read
    (compute-sanitizer memcheck) at the walker's W S product, with no register spilled:
    Triton 3.6's code for these dots, not the kernel's indices (shared memory is the
    compiler's alone). benchmarks/probes/dot_warps_repro.py shows the kind: a
    loop-carried fp32 value cast to a dot's B operand goes wrong at many warps and
    widths on sm_90, while loaded or freshly made operands do not.
    The tuner's run worker survives a fault and quarantines the config, but each fault
    costs a worker and in-process timing (KILN_TUNE_TIMING=inprocess) loses the process:
    these are never candidates."""
    return shape.dtype != torch.float32 and warps >= 8 and bv <= 32


def _spills_badly(shape: DeltaShape, chunk: int, warps: int) -> bool:
    """The one-pass form on 4 warps at CHUNK 64 with wide keys: on sm_90 (Triton 3.6,
    K = 256) these spilled over 500 registers, and two of them (BV 16 and 32, one
    stage) computed wrong outputs or faulted with an illegal address on an H100: a
    fault in the tuner's in-process timing would take the compile down, so they are
    never candidates. (The staged form there takes 255 registers and spills 14-40
    words, and runs right: it stays.)"""
    return chunk == 64 and warps == 4 and pow2(shape.key_dim) >= 128


def step_warps(block: int) -> int:
    """Warps for a decode step's program holding a state block of `block` fp32: 128 a
    thread, 4 to 16 warps. Fewer warps ran faster: at Qwen3-Next's shape with whole
    heads a program (a 128 x 128 block, 32 programs) the step took 7.8 us on 4 warps
    (255 registers, no spills on sm_90), 12.7 on 8 and 15.4 on 16 (H200, in isolation);
    128 x 32 and 128 x 64 blocks were faster on 4 warps than 8 too: each reduction over
    the key dim crosses fewer warps. The default block is 32 columns (heuristic): in the
    Qwen3-Next slice 5.0 us a step against whole heads' 6.3 (H200, 2026-12-01)."""
    return min(16, max(4, block // (128 * 32)))


def heuristic(shape: DeltaShape, target: Target) -> Config:
    """The untuned choice (timed tuning tries its neighbours). A one-step op has no chunks.

    The one-pass form, tuned on an H100 at the seed's shape (K = V = 256, bf16, T = 8192),
    ran 32-step chunks, 64 value columns, 4 warps and two stages fastest (1.80 ms; 16-step
    chunks 2.34 ms, 64-step at 8 warps 2.46 ms; one stage 1.6-3x slower). Its walk does four
    products a chunk, the staged form's two, with the outputs off the sequential path: the
    staged form is the choice wherever T may span several chunks. One register allocation
    serves every role: the staged form takes 4 warps, where on sm_90 at the seed's shape the
    whole kernel at 64-step chunks and 64 columns takes 255 registers and spills 14-40 words
    (two programs an SM; 8 warps, one program an SM, ran 1.9x slower on an H200), 64-step
    chunks (half the stored states of 32), and the narrowest value blocks whose walkers all
    fit on the chip at once, the other slots left to the output programs: at the seed's
    shape 64 columns (144 walkers), at Qwen3-Next's (32 value heads of 128) 32 columns (128
    walkers). fp32 inputs multiply on FMA units, register-hungry: 32-step chunks, 8 warps (4
    spilled 156-2232 registers at Qwen3-Next's shape, 8 spill 12; one program an SM). The
    interpreter runs small chunks fastest (the staged form at 32)."""
    vp = pow2(shape.value_dim)
    if shape.static_t == 1:
        bv = min(32, vp)
        return Config.make(step_warps(pow2(shape.key_dim) * bv), 1, CHUNK=16, BV=bv)
    space = config_space(shape)
    staged = [c for c in space if c["STAGED"]]
    if target.backend == "interpret":
        return Config.make(4, 1, CHUNK=32 if staged else 16, BV=min(64, vp),
                           STAGED=int(bool(staged)))
    if staged:
        wide = shape.dtype == torch.float32  # FMA dots: 8 warps, one program an SM
        chunk = max(c["CHUNK"] for c in staged)  # fp32: 32
        sequences = shape.sequences if isinstance(shape.sequences, int) else 1
        slots = target.multiprocessors * (1 if wide else 2)
        blocks = sorted({c["BV"] for c in staged})
        fit = [b for b in blocks
               if sequences * shape.value_heads * -(-shape.value_dim // b) <= slots]
        return Config.make(8 if wide else 4, 2, CHUNK=chunk, BV=fit[0] if fit else blocks[-1],
                           STAGED=1)
    longest = max(c["CHUNK"] for c in space)
    return Config.make(4, 2, CHUNK=min(32, longest), BV=min(64, vp), STAGED=0)


def generate(region: Region, plan: DispatchPlan, target: Target) -> KernelSpec:
    """The gated delta rule kernel of `region`; raises CodegenUnsupported saying why not."""
    shape = analyse(region, plan)
    p = SymbolicArgs(plan.symbols)
    em = Emitter(region, plan, p, target)
    for name in list(region.inputs) + list(region.outputs):
        p.check_extent(plan.values[name].numel)
    decode = shape.static_t == 1
    if (shape.final_store is not None or shape.epilogue) and not decode:
        raise CodegenUnsupported("the chunked kernel takes no epilogue and does not write "
                                 "the state in place")
    lines = decode_body(em, p, shape) if decode else chunked_body(em, p, shape)
    name = kernel_name("gated_delta", region)
    tunables = ["CHUNK", "BV"] if decode else ["CHUNK", "BV", "STAGED"]
    scratch = (_epilogue_scratch(shape, p) if shape.epilogue else []) if decode else \
        _scratch(shape, p)
    # the grid first: a size only the grid reads (the batch, when no load's offset uses
    # it) is still a kernel parameter, as the launcher passes every size it binds
    heads, seqs = p.grid(shape.value_heads), p.grid(shape.sequences)
    columns = f"cdiv({p.grid(shape.value_dim)}, BV)"
    if decode:
        grid = (columns, heads, seqs)
    else:  # preparers (sequence, chunk, head), walkers (sequence, head, columns), outputs
        chunks = f"cdiv({p.grid(shape.seq)}, CHUNK)"
        grid = (f"({heads}) * ({seqs}) * ({chunks} + {columns} + "
                f"(({chunks}) * ({columns}) if STAGED else 0))",)
    params = p.names() + [b.name for b in scratch] + [f"{t}: tl.constexpr" for t in tunables]
    source = module_source(name, params, lines, em.helpers, target, p.describe())
    configs = config_space(shape)
    default = heuristic(shape, target)
    if default not in configs:
        configs.insert(0, default)
    hi = bounds_of(shape.seq, plan.symbols).hi if shape.cu_seqlens is None else None
    meta = {"timing_fill": _timing_fill(region, shape),
            "key_dim": shape.key_dim, "value_dim": shape.value_dim,
            "key_dim_pad": pow2(shape.key_dim), "value_dim_pad": pow2(shape.value_dim),
            "dtype": str(shape.dtype).replace("torch.", ""),
            "chunked": not decode, "seq_hi": hi}
    return KernelSpec(name, source, p.args(), tunables, grid, configs, default,
                      "gated_delta", meta, 64 if p.needs_int64 else 32, scratch=scratch)


def _timing_fill(region: Region, shape: DeltaShape) -> dict[str, dict[str, str]]:
    """The tuner's inputs as models give the op (timing.SHAPED): unit-norm queries and
    keys, log decays <= 0 and betas in (0, 1), where an operand is a region input read
    directly or through views (a slice of a unit row is at most unit norm), and packed
    sequences of even lengths. On plain
    random inputs the recurrence overflowed, and the tuner's output check could not
    tell a wrong candidate from a right one (H200, seed shape: no candidate matched)."""
    ops = {o.name: o for o in region.ops}
    fill: dict[str, dict[str, str]] = {}
    kinds = ((shape.q, "unit_rows"), (shape.k, "unit_rows"), (shape.g, "log_decay"),
             (shape.beta, "unit_interval"))
    for name, kind in kinds:
        while name in ops and is_view(ops[name], ops) and isinstance(ops[name].args[0], Ref):
            name = ops[name].args[0].name
        if name in region.inputs and (name not in fill or fill[name] == {kind: "1"}):
            fill[name] = {kind: "1"}
    if shape.cu_seqlens in region.inputs:  # zeros: every sequence empty, nothing timed
        fill[shape.cu_seqlens] = {"sequence_bounds": str(shape.seq)}
    return fill


def _epilogue_scratch(shape: DeltaShape, p: SymbolicArgs) -> list[Scratch]:
    """body.EPILOGUE's buffers, when a head's columns are split over programs: its o
    blocks (fp32) and a counter a (sequence, value head)."""
    heads = f"({p.grid(shape.sequences)}) * {shape.value_heads}"
    vp = pow2(shape.value_dim)
    parts, counts = EPILOGUE
    return [Scratch(parts, torch.float32, f"{heads} * {vp} if BV < {vp} else 1"),
            Scratch(counts, torch.int32, f"{heads} if BV < {vp} else 1", zeroed=True)]


def _scratch(shape: DeltaShape, p: SymbolicArgs) -> list[Scratch]:
    """body.SCRATCH's buffers: a row per (token, value head)."""
    rows = f"({p.grid(shape.batch)}) * ({p.grid(shape.seq)}) * {shape.value_heads}"
    kp, vp = pow2(shape.key_dim), pow2(shape.value_dim)
    counters, w, u, a, g = SCRATCH
    h, flags = staged.SCRATCH
    seqs = p.grid(shape.sequences)
    slots = f"(({p.grid(shape.batch)}) * cdiv({p.grid(shape.seq)}, CHUNK) + {seqs})"
    walkers = f"({seqs}) * {shape.value_heads} * cdiv({shape.value_dim}, BV)"
    return [Scratch(counters, torch.int32, "3", zeroed=True),
            Scratch(w, shape.dtype, f"{rows} * {kp}"),
            Scratch(u, shape.dtype, f"{rows} * {vp}"),
            Scratch(a, shape.dtype, f"{rows} * CHUNK"),
            Scratch(g, torch.float32, rows),
            Scratch(h, shape.dtype, f"{slots} * {shape.value_heads * kp * vp} if STAGED else 1"),
            Scratch(flags, torch.int32, f"{walkers} if STAGED else 1", zeroed=True)]
