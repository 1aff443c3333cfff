"""The tiny Llama compiled for the local GPU matches eager on the GPU."""

import copy

import pytest
import torch

import kiln
from kiln.models.llama import example_inputs, tiny_llama
from tests.helpers import rel_err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-2),
                                       (torch.bfloat16, 1e-2)])
def test_tiny_llama_cuda_prefill_decode(dtype, tol):
    model = tiny_llama(dtype=dtype).cuda()
    model.setup_cache(dtype)
    eager = copy.deepcopy(model)
    ref32 = copy.deepcopy(model).float()  # what both low-precision runs approximate
    ref32.setup_cache(torch.float32)
    args, dynamic = example_inputs(model.cfg, seq_len=8)
    args = tuple(a.cuda() for a in args)
    exe = kiln.compile(model, args, dynamic_shapes=dynamic, target="cuda")
    pos = 0
    for n in (13, 1, 1, 1):
        tokens = torch.randint(0, model.cfg.vocab_size, (1, n), device="cuda")
        input_pos = torch.arange(pos, pos + n, device="cuda")
        out, ref, exact = exe(tokens, input_pos), eager(tokens, input_pos), ref32(tokens, input_pos)
        # kiln's rounding error is on the order of eager's own (both vs an fp32 run).
        err, eager_err = rel_err(out, exact), rel_err(ref, exact)
        assert err <= max(tol, 1.5 * eager_err), (n, err, eager_err)
        pos += n


@pytest.mark.gpu
def test_cuda_graph_decode_matches_graph_free_decode():
    """Decode through captured CUDA graphs gives the same tokens as graph-free decode."""
    results = []
    for graphs in (False, True):
        model = tiny_llama(dtype=torch.float16).cuda()
        model.setup_cache(torch.float16)
        args, dynamic = example_inputs(model.cfg, seq_len=8)
        exe = kiln.compile(model, tuple(a.cuda() for a in args), dynamic_shapes=dynamic,
                           target="cuda")
        if graphs:
            exe.cuda_graphs(when=lambda tokens, pos: tokens.shape[-1] == 1)
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, model.cfg.vocab_size, (1, 12), generator=gen).cuda()
        logits = exe(prompt, torch.arange(12, device="cuda"))
        tokens, all_logits = [int(logits[0, -1].argmax())], [logits[0, -1]]
        for i in range(20):
            logits = exe(torch.tensor([[tokens[-1]]], device="cuda"),
                         torch.tensor([12 + i], device="cuda"))
            tokens.append(int(logits[0, -1].argmax()))
            all_logits.append(logits[0, -1])
        if graphs:
            assert len(exe._graphs.graphs) == 1  # one bucket: batch 1, one token
        results.append((tokens, torch.stack(all_logits)))
    assert results[0][0] == results[1][0]
    assert rel_err(results[1][1], results[0][1]) < 1e-3


@pytest.mark.gpu
def test_captured_graph_keeps_its_memory_alive():
    """A graph replays into its own arena: freeing everything else and emptying the
    allocator's cache must not take that memory away (it once did: illegal address)."""
    import gc

    model = tiny_llama(dtype=torch.float16).cuda()
    model.setup_cache(torch.float16)
    eager = copy.deepcopy(model)
    args, dynamic = example_inputs(model.cfg, seq_len=8)
    exe = kiln.compile(model, tuple(a.cuda() for a in args), dynamic_shapes=dynamic,
                       target="cuda").cuda_graphs()
    tok, pos = torch.tensor([[3]], device="cuda"), torch.tensor([0], device="cuda")
    exe(tok, pos)  # capture
    eager(tok, pos)  # the same step, so both caches hold position 0
    gc.collect()
    torch.cuda.empty_cache()
    junk = [torch.randn(1 << 20, device="cuda") for _ in range(64)]  # reuse freed memory
    for i in range(1, 6):
        tok, pos = torch.tensor([[i + 3]], device="cuda"), torch.tensor([i], device="cuda")
        out, ref = exe(tok, pos), eager(tok, pos)
        torch.cuda.synchronize()
        assert rel_err(out, ref) <= 1e-2
    del junk
