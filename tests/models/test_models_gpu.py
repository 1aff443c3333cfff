"""The checkpoint comparisons on a CUDA GPU, in fp16 and bf16, against transformers in fp32."""

import copy

import pytest
import torch

import kiln.models
from kiln.cli import main
from tests.helpers import assert_lowp_close, rel_err
from tests.models.support import FAMILIES, run_alone, run_batched

pytestmark = pytest.mark.gpu
DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def gpu_llms(checkpoints):
    """(family, dtype, paged) -> a kiln LLM compiled for the local GPU."""
    cache = {}

    def get(family, dtype, paged=False):
        key = (family, dtype, paged)
        if key not in cache:
            cache[key] = kiln.models.load(checkpoints[family][0], dtype=dtype, target="cuda",
                                          max_batch_size=3, paged=paged, block_size=4)
        return cache[key]

    return get


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_on_cuda(family, dtype, checkpoints, gpu_llms):
    _, hf_model = checkpoints[family]
    llm = gpu_llms(family, dtype)
    assert llm.model.lm_head.weight.is_cuda and llm.model.lm_head.weight.dtype == dtype
    tokens = torch.randint(3, llm.cfg.vocab_size, (1, 20))
    with torch.no_grad():
        ref = hf_model(tokens).logits  # fp32 on the CPU: the reference
        # transformers' own fp16/bf16 run on the same GPU: the peer, and the scale of the
        # rounding error a low-precision run has (logit tolerance 1e-2, or no worse than it)
        hf_low = copy.deepcopy(hf_model).to("cuda", dtype)
        ref_low = hf_low(tokens.cuda()).logits.float().cpu()
    out = [llm.forward(tokens[:, :13], torch.arange(13))]
    for p in range(13, 20):
        out.append(llm.forward(tokens[:, p:p + 1], torch.tensor([p])))
    out = torch.cat(out, dim=1).float().cpu()
    # The sequence no worse than eager's own error (x1.5), each position within 3x: in
    # bf16 kiln's error equals eager's (H200, 10-12 token sets a family: mean 1.07e-2
    # against 1.06e-2, median ratio 1.00), yet a position alone passes the 1.5x rule
    # only ~99% of the time, on a 96-word vocabulary (benchmarks/RESULTS.md, 11-29).
    assert_lowp_close(out, ref_low, ref, 1e-2)
    for p in range(20):
        assert_lowp_close(out[:, p], ref_low[:, p], ref[:, p], 1e-2, slack=3.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_cache_and_batched_decode_on_cuda(dtype, gpu_llms):
    contiguous, paged = gpu_llms("llama3.1", dtype), gpu_llms("llama3.1", dtype, paged=True)
    gen = torch.Generator().manual_seed(1)
    vocab = contiguous.cfg.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen) for n in (3, 9, 14)]
    steps = torch.randint(3, vocab, (3, 5), generator=gen)
    alone = [run_alone(contiguous, p, s).float() for p, s in zip(prompts, steps)]
    assert rel_err(run_alone(paged, prompts[2], steps[2]).float(), alone[2]) <= 1e-2
    # a lone row decodes by the narrow version's GEMVs, a batch by the tiled plan: two
    # 16-bit results, each within ~1e-2 of the truth (test_logits_match_transformers_on_cuda)
    tol = 2e-2
    for llm in (contiguous, paged):
        for got, want in zip(run_batched(llm, prompts, steps), alone):
            assert rel_err(got.float(), want) <= tol


@pytest.mark.parametrize("paged", [False, True])
def test_generation_on_cuda(paged, gpu_llms):
    llm = gpu_llms("qwen2", torch.bfloat16, paged)
    outs = llm.generate(["the quick brown", "hello"], max_new_tokens=24, ignore_eos=True)
    assert [len(o.ids) for o in outs] == [24, 24]
    assert all(isinstance(o.text, str) and o.tokens_per_s > 0 for o in outs)


def test_cli_generate_on_cuda(checkpoints, capsys):
    path, _ = checkpoints["llama3.1"]
    rc = main(["generate", "--model", str(path), "--prompt", "the lazy dog", "--target",
               "cuda", "--dtype", "bfloat16", "--max-new-tokens", "16", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.startswith("the lazy dog") and "generated 16" in err


@pytest.mark.parametrize("paged", [False, True])
def test_cuda_graph_decode_gives_graph_free_tokens(paged, checkpoints):
    """Decode through CUDA graphs (batch of 3 padded to the bucket of 4) gives exactly
    the tokens graph-free decode gives, for both caches."""
    path = checkpoints["llama3.1"][0]
    prompts = [[5, 9, 13], list(range(3, 12)), list(range(20, 34))]
    runs = []
    for graphs in (False, True):
        llm = kiln.models.load(path, dtype=torch.float16, target="cuda", max_batch_size=4,
                               paged=paged, block_size=4, cuda_graphs=graphs)
        assert llm.cuda_graphs == graphs
        out = llm.generate(prompts, max_new_tokens=24, ignore_eos=True)
        runs.append([g.ids for g in out])
        if graphs:
            assert set(llm.decode_module._graphs.graphs) and len(
                llm.decode_module._graphs.graphs) <= len(llm.buckets)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("paged", [False, True])
def test_saved_llm_on_cuda_generates_the_same_tokens(paged, gpu_llms, tmp_path):
    """A saved GPU LLM loads its kernel binaries (nothing compiled), captures its decode
    graphs again and decodes exactly as the LLM it was saved from."""
    llm = gpu_llms("llama3.1", torch.bfloat16, paged)
    llm.save(tmp_path / "llm.kiln")
    loaded = kiln.models.load(tmp_path / "llm.kiln")
    assert loaded.target == llm.target and loaded.cuda_graphs and loaded.paged == paged
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    assert [g.ids for g in loaded.generate(prompts, max_new_tokens=12, ignore_eos=True)] == \
        [g.ids for g in llm.generate(prompts, max_new_tokens=12, ignore_eos=True)]
    assert loaded.load_s < llm.load_s
