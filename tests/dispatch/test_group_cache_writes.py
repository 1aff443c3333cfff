"""A decode step's K and V cache writes in one copy kernel (dispatch/group_cache_writes.py),
on the generated kernels (interpret target): the caches hold what eager writes and the
logits match, for index_put writes (kiln's Llama) and index_copy_ ones (kiln bench's
gpt-fast-style subject)."""

import torch

import kiln
from kiln.bench import subject
from kiln.dispatch import fold_cache_writes
from kiln.ir.ops import OpCategory, category
from kiln.ir.plan import RegionKind


def _writes(plan):
    return [r for r in plan.regions if r.kind == RegionKind.COPY
            and any(category(o.target) == OpCategory.SCATTER for o in r.ops)]


def test_bench_subject_writes_k_and_v_in_one_kernel_and_matches_eager(monkeypatch):
    # the writes apart from the attention (dispatch/fold_cache_writes.py folds them in)
    monkeypatch.setattr(fold_cache_writes, "fold_cache_writes_of", lambda plan: 0)
    s = subject.PRESETS["tiny"].with_(layers=2)
    model, ref = subject.build(s, torch.float32, "cpu"), subject.build(s, torch.float32, "cpu")
    ref.load_state_dict(model.state_dict())
    args = (torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]))
    exe = kiln.compile(model, args, target="interpret")
    writes = _writes(exe.program.plan)
    assert len(writes) == s.layers and all(len(r.outputs) == 2 for r in writes)
    assert all(type(exe.program.kplan.kernels[r.name]).__name__ == "TritonKernel"
               for r in writes)
    for pos in range(4):
        tok = torch.randint(0, s.vocab, (1, 1))
        p = torch.tensor([pos])
        got, want = exe(tok, p), ref(tok, p)
        assert ((got - want).norm() / want.norm()).item() < 1e-5, pos
    for name, buf in ref.named_buffers():
        if "cache" in name:
            assert torch.allclose(exe.state[name], buf, atol=1e-6), name


class TwoCaches(torch.nn.Module):
    def __init__(self, wa=8, wb=8):
        super().__init__()
        self.wa, self.wb = wa, wb
        self.register_buffer("a", torch.zeros(6, wa))
        self.register_buffer("b", torch.zeros(6, wb))

    def forward(self, x, pos):  # x [1, wa + wb]
        self.a.index_copy_(0, pos, x[:, :self.wa] * 2)
        self.b.index_copy_(0, pos, x[:, self.wa:] + 1)
        return self.a.sum(0) + self.b.sum(0)[:1]


def test_writes_of_one_shape_merge_and_others_do_not():
    for wb, kernels in ((8, 1), (5, 2)):
        model, ref = TwoCaches(8, wb), TwoCaches(8, wb)
        exe = kiln.compile(model, (torch.randn(1, 8 + wb), torch.tensor([0])), target="interpret")
        assert len(_writes(exe.program.plan)) == kernels, wb
        for pos in (2, 4):
            x, p = torch.randn(1, 8 + wb), torch.tensor([pos])
            assert torch.allclose(exe(x, p), ref(x, p), atol=1e-5)
        assert torch.equal(exe.state["a"], ref.a) and torch.equal(exe.state["b"], ref.b)
