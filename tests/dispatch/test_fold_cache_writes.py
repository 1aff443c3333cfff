"""A decode step's K/V cache writes folded into the attention (dispatch/
fold_cache_writes.py, templates/attention `_cache_writes`): which plans fold, the
kernel's numerics and the caches it leaves under Triton's interpreter against eager,
the row no split reads, a declined fold, and which program stores the row (run as
Python: the interpreter runs programs one after another, so only the rule shows that
the program reading the row is the one that wrote it)."""

import itertools
import re

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.bench import subject
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.ir.ops import OpCategory, category
from kiln.ir.plan import RegionKind
from tests.helpers import rel_err


def _regions(exe, kind):
    return [r for r in exe.program.plan.regions if r.kind == kind]


def _scatter_regions(exe):
    return [r for r in _regions(exe, RegionKind.COPY)
            if any(category(o.target) == OpCategory.SCATTER for o in r.ops)]


def test_bench_subject_writes_its_caches_in_the_attention_and_matches_eager():
    """gpt-fast's index_copy_ writes, a 512-slot cache: positions in every split of
    the keys (4 at most here), at block edges."""
    s = subject.PRESETS["tiny"].with_(layers=2, max_len=512)
    model, ref = subject.build(s, torch.float32, "cpu"), subject.build(s, torch.float32, "cpu")
    ref.load_state_dict(model.state_dict())
    exe = kiln.compile(model, (torch.zeros(1, 1, dtype=torch.long), torch.tensor([0])),
                       target="interpret")
    attention = _regions(exe, RegionKind.ATTENTION)
    assert not _scatter_regions(exe) and len(attention) == s.layers
    for r in attention:
        assert len(r.outputs) == 3 and set(r.outputs[1:]) == set(r.inplace)
        assert any("cache writes folded in" in n for n in r.notes)
        assert isinstance(exe.program.kplan.kernels[r.name], TritonKernel)
    for pos in (0, 1, 63, 64, 200, 300, 511):
        tok = torch.randint(0, s.vocab, (1, 1))
        p = torch.tensor([pos])
        assert rel_err(exe(tok, p), ref(tok, p)) < 1e-5, pos
    for name, buf in ref.named_buffers():
        if "cache" in name:
            assert torch.allclose(exe.state[name], buf, atol=1e-6), name


class BeforeThePosition(torch.nn.Module):
    """Writes the step's key and value at `pos`, attends to the keys before it only:
    no program reads the row written, which must still land in the caches."""

    def __init__(self, slots=200, hd=16):
        super().__init__()
        self.register_buffer("k", torch.randn(1, 2, slots, hd))
        self.register_buffer("v", torch.randn(1, 2, slots, hd))

    def forward(self, q, kn, vn, pos):
        self.k.index_copy_(2, pos, kn * 2)
        self.v.index_copy_(2, pos, vn + 1)
        mask = (torch.arange(self.k.shape[2]) < pos)[None, :]
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask,
                                              enable_gqa=True)


def test_a_row_no_program_reads_is_still_written():
    model, ref = BeforeThePosition(), BeforeThePosition()
    ref.load_state_dict(model.state_dict())
    args = (torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16),
            torch.tensor([5]))
    exe = kiln.compile(model, args, target="interpret")
    (attention,) = _regions(exe, RegionKind.ATTENTION)
    assert len(attention.outputs) == 3 and not _scatter_regions(exe)
    for pos in (1, 70, 150):
        a = (torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16),
             torch.tensor([pos]))
        assert rel_err(exe(*a), ref(*a)) < 1e-5, pos
        assert torch.equal(exe.state["k"], ref.k) and torch.equal(exe.state["v"], ref.v)


@pytest.mark.parametrize("which", ["before the position", "bench subject"])
def test_a_declined_fold_writes_apart(monkeypatch, which):
    """Should the template decline the writes, they run as a copy region again and the
    attention keeps its kernel; in the bench subject the rotary tables recomputed in
    the attention since the fold (recompute_cheap) are computed in both."""
    from kiln.codegen import select_kernels
    from kiln.codegen.expr.values import CodegenUnsupported

    real = select_kernels.TEMPLATES[RegionKind.ATTENTION]

    def declines_writes(region, plan, target):
        if any(category(o.target) == OpCategory.SCATTER for o in region.ops):
            raise CodegenUnsupported("a test's refusal")
        return real(region, plan, target)

    monkeypatch.setitem(select_kernels.TEMPLATES, RegionKind.ATTENTION, declines_writes)
    if which == "bench subject":
        s = subject.PRESETS["tiny"].with_(layers=2)
        model, ref = subject.build(s, torch.float32, "cpu"), subject.build(s, torch.float32, "cpu")
        steps = [(torch.randint(0, s.vocab, (1, 1)), torch.tensor([p])) for p in (0, 1, 7)]
    else:
        model, ref = BeforeThePosition(), BeforeThePosition()
        steps = [(torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16),
                  torch.tensor([p])) for p in (9, 3)]
    ref.load_state_dict(model.state_dict())
    exe = kiln.compile(model, steps[0], target="interpret")
    attention = _regions(exe, RegionKind.ATTENTION)
    assert len(_scatter_regions(exe)) == len(attention)
    for r in attention:
        assert r.outputs == [r.anchor().name] and any("run apart" in n for n in r.notes)
        assert isinstance(exe.program.kplan.kernels[r.name], TritonKernel)
    for a in steps:
        assert rel_err(exe(*a), ref(*a)) < 1e-5
    for name, buf in ref.named_buffers():
        if buf.shape and name in exe.state:
            assert torch.allclose(exe.state[name], buf, atol=1e-6), name


def test_the_program_reading_the_row_writes_it():
    """The kernel's split range and writer lines, run as Python for every split of a
    tile: exactly one program stores the row, the one whose keys hold it when any
    does (so no program can read the row before it is written)."""
    model = BeforeThePosition()
    args = (torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16),
            torch.tensor([5]))
    exe = kiln.compile(model, args, target="interpret")
    (attention,) = _regions(exe, RegionKind.ATTENTION)
    source = exe.program.kplan.kernels[attention.name].spec.source
    lines = [x.strip() for x in source.splitlines()]
    first = lines.index("lo = kv_start")
    last = next(i for i, x in enumerate(lines) if x.startswith("writer0 = "))
    body = [x for x in lines[first:last + 1] if not x.startswith("mid =")]
    code = "\n".join(("    " + x if x.startswith(("per_split", "lo = kv_start +", "hi = tl."))
                      else x) for x in body)

    class tl:
        @staticmethod
        def cdiv(a, b):
            return -(-a // b)
        minimum, maximum = min, max

    block = 16
    for kv_start, kv_end, n_split, wpos in itertools.product(
            range(0, 65, block), range(0, 100, 7), (1, 2, 3, 4, 7), range(0, 100, 3)):
        kv_start = min(kv_start, kv_end // block * block)
        writers = []
        for pid_s in range(n_split):
            env = {"tl": tl, "kv_start": kv_start, "kv_end": kv_end, "n_split": n_split,
                   "pid_s": pid_s, "BLOCK_N": block, "KV_SPLIT": max(2, n_split),
                   "wpos0": wpos}
            exec(code, env)
            if env["writer0"]:
                writers.append((env["lo"], env["hi"]))
        where = (kv_start, kv_end, n_split, wpos)
        assert len(writers) == 1, (where, writers)
        if kv_start <= wpos < kv_end:
            assert writers[0][0] <= wpos < writers[0][1], (where, writers)
    assert re.search(r"tl\.debug_barrier\(\)", source)


class WriteThenAttend(torch.nn.Module):
    """Writes the step's key and value at `pos` over a cache of random rows and attends
    to the keys up to it; a query along the new key makes that key's weight ~1, so the
    output is the new value, not whatever the row held before."""

    def __init__(self, slots=2048, hd=128):
        super().__init__()
        self.register_buffer("k", torch.randn(1, 2, slots, hd))
        self.register_buffer("v", torch.randn(1, 2, slots, hd))

    def forward(self, q, kn, vn, pos):  # rows computed in the step, as a model's are
        self.k.index_copy_(2, pos, kn * 2)
        self.v.index_copy_(2, pos, vn + 1)
        mask = (torch.arange(self.k.shape[2], device=q.device) <= pos)[None, :]
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask,
                                              enable_gqa=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_on_the_gpu_the_program_reading_the_row_reads_what_it_wrote(dtype):
    """2 KV heads over 2048 slots: a step's keys split over up to 16 programs a head,
    the written row in any of them. A program reading its row before the store lands
    would attend to the old row: the output would be that row's value, not the new."""
    model = WriteThenAttend().to("cuda", dtype)
    ref = WriteThenAttend().cuda()
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})

    def step(pos, gen):
        kn = torch.randn(1, 2, 1, 128, generator=gen).cuda()
        return (kn.repeat_interleave(2, dim=1) * 4, kn, torch.randn(1, 2, 1, 128, generator=gen)
                .cuda(), torch.tensor([pos], device="cuda"))

    gen = torch.Generator().manual_seed(0)
    first = step(0, gen)
    exe = kiln.compile(model, tuple(x.to(dtype) if x.is_floating_point() else x
                                    for x in first), target="cuda")
    assert not _scatter_regions(exe)
    for pos in (0, 1, 63, 64, 300, 1000, 1500, 2047):
        a = step(pos, gen)
        got = exe(*(x.to(dtype) if x.is_floating_point() else x for x in a))
        want = ref(*a)
        assert rel_err(got.float(), want) < 2e-2, pos
        assert rel_err(got.float(), a[2].repeat_interleave(2, dim=1) + 1) < 5e-2, pos
    assert rel_err(exe.state["k"].float(), ref.k) < 1e-2
    assert rel_err(exe.state["v"].float(), ref.v) < 1e-2


def test_kiln_llama_at_one_row_folds_its_writes_and_matches_transformers(tmp_path):
    """kiln.models' contiguous cache at max batch 1 writes `cache[rows, pos] = k` with
    values broadcast over the indexed rows ([KV, D]): folded too, against transformers
    over a prompt and decode steps (the interpret target: generated kernels)."""
    pytest.importorskip("transformers")
    import kiln.models
    from tests.models.support import make_checkpoint, run_alone

    hf_model = make_checkpoint(tmp_path / "llama3.1", "llama3.1", num_hidden_layers=1)
    llm = kiln.models.load(tmp_path / "llama3.1", target="interpret", dtype=torch.float32)
    (attention,) = [r for r in llm.decode_module.program.plan.regions
                    if r.kind == RegionKind.ATTENTION]
    assert len(attention.outputs) == 3 and len(attention.inplace) == 2
    vocab = llm.cfg.vocab_size
    prompt, steps = torch.randint(3, vocab, (6,)), torch.randint(3, vocab, (3,))
    ours = run_alone(llm, prompt, steps)
    with torch.no_grad():
        ref = hf_model(torch.cat([prompt, steps])[None]).logits[0, len(prompt) - 1:]
    assert rel_err(ours, ref) <= 1e-4
