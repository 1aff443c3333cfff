"""Each rank of a tensor-parallel kiln.models.load reads only its slices of a checkpoint
(kiln.models.rank_weights), as the plan's derived sharding cuts the model, and the
ranks together compute what one device does.

One gloo run of two ranks: a DeepSeek-V3 checkpoint made by transformers (fp32, then
the same weights in DeepSeek's fp8 layout, kept fp8: its routed experts too) and a
transformers Llama quantised to fp8 at load. The sizes put every cut on whole
128-blocks (8 heads of 32 + 32 wide queries and keys, 32 wide values, expert widths
256; the Llama's 2 heads of 128, MLP width 512). Every safetensors read is counted
(tests/parallel/read_bytes.py).
"""

from __future__ import annotations

import pytest
import torch

from kiln.errors import ShapeError
from tests.helpers import rel_err
from tests.parallel.spmd import run_spmd

pytestmark = pytest.mark.filterwarnings("ignore")
transformers = pytest.importorskip("transformers")

DEEPSEEK = dict(num_hidden_layers=1, first_k_dense_replace=0, num_attention_heads=8,
                num_key_value_heads=8, qk_nope_head_dim=32, qk_rope_head_dim=32,
                v_head_dim=32, moe_intermediate_size=256)
LLAMA = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2,
             num_key_value_heads=2, num_hidden_layers=1)
PROMPT, STEPS = 7, 3  # a prefill of 7 tokens, then 3 decode steps


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.models.support import make_checkpoint
    from tests.models.test_deepseek_v3 import make_hf_model
    from tests.models.test_deepseek_v3_fp8 import write_fp8_checkpoint

    root = tmp_path_factory.mktemp("rank_weights")
    deepseek = make_hf_model(seed=2, **DEEPSEEK)
    deepseek.save_pretrained(str(root / "deepseek_v3"))
    write_fp8_checkpoint(root / "deepseek_v3_fp8", deepseek)
    llama = make_checkpoint(root / "llama", "llama3.1", **LLAMA)
    return root, deepseek, llama


def _logits(llm, tokens) -> torch.Tensor:
    """Every position's logits: a prefill of PROMPT tokens, then decode steps."""
    out = [llm.forward(tokens[:, :PROMPT], torch.arange(PROMPT))]
    for p in range(PROMPT, PROMPT + STEPS):
        out.append(llm.forward(tokens[:, p:p + 1], torch.tensor([p])))
    return torch.cat(out, 1)


def _ranks(rank, world, root, tokens):
    """Per load: this rank's logits and the checkpoint bytes it read (by tensor)."""
    import kiln.models
    from tests.parallel.read_bytes import count_reads

    out = {}
    for name, source, kw in (("deepseek_v3", "deepseek_v3", {}),
                             ("fp8", "deepseek_v3_fp8", {"keep_fp8": True}),
                             ("llama_fp8", "llama", {"quantize": "fp8"})):
        with count_reads() as counted:
            llm = kiln.models.load(root / source, dtype=torch.float32, max_seq_len=16,
                                   tensor_parallel_size=world, **kw)
        with torch.no_grad():
            out[name] = dict(logits=_logits(llm, tokens), **counted)
        del llm
    return out


def _one_device(root, name, **kw):
    """The same checkpoint loaded whole by one process, run eagerly (the compiled
    one-device LLM matches its eager model: tests/models)."""
    from kiln.models import deepseek_v3_checkpoint, hf
    from kiln.models.fp8 import quantize_fp8

    loader = deepseek_v3_checkpoint if name.startswith("deepseek") else hf
    quantize = kw.pop("quantize", False)
    model, _ = loader.load_checkpoint(root / name, torch.float32, max_seq_len=16, **kw)
    if quantize:
        quantize_fp8(model)
    model.setup_cache()
    return model


def test_each_rank_reads_its_slices_and_the_ranks_match_one_device(checkpoints):
    from tests.parallel.read_bytes import checkpoint_bytes

    root, deepseek, llama = checkpoints
    tokens = torch.randint(0, 96, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = {"deepseek_v3": deepseek(tokens).logits,
                "fp8": _logits(_one_device(root, "deepseek_v3_fp8", keep_fp8=True), tokens),
                "llama_fp8": _logits(_one_device(root, "llama", quantize=True), tokens)}
    ranks = run_spmd(_ranks, 2, root, tokens, timeout=400)
    for name, source in (("deepseek_v3", "deepseek_v3"), ("fp8", "deepseek_v3_fp8"),
                         ("llama_fp8", "llama")):
        whole = checkpoint_bytes(root / source)
        for got in ranks:
            err = rel_err(got[name]["logits"], want[name])
            assert err <= 1e-4, (name, err)
            assert got[name]["bytes"] < 0.6 * whole, (name, got[name]["bytes"], whole)
    ds = ranks[1]["deepseek_v3"]["by_name"]
    layer = "model.layers.0."
    q_b = layer + "self_attn.q_b_proj.weight"
    assert ds[q_b] * 2 == deepseek.get_parameter(q_b).nbytes  # its heads only
    assert ds[layer + "self_attn.q_a_proj.weight"] == 64 * 48 * 4  # seeded whole
    assert ds[layer + "mlp.experts.3.gate_proj.weight"] == 128 * 64 * 4  # half its width
    fp8 = ranks[0]["fp8"]["by_name"]
    assert fp8[q_b] == 256 * 48  # e4m3: its 256 rows, one byte each
    assert fp8[q_b + "_scale_inv"] == 2 * 1 * 4  # and their two row blocks' scales


def test_an_fp8_slice_through_a_block_is_a_clear_error(checkpoints):
    """A cut the plan would never make (its fp8 rules keep whole blocks) still cannot
    reach the model: the reader names the weight, the cut and what to do."""
    from kiln.models import hf

    root = checkpoints[0]
    meta, _ = hf.load_checkpoint(root / "llama", torch.float32, weights=False)
    reader = hf.rank_reader(meta, root / "llama", "cpu", quantize=True)
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ShapeError, match=r"fp8 weight .*q_proj.weight \[256, 256\] .* slice of "
                       r"axis 0 is 64:192 of 256, which cuts through a block") as info:
        reader.read({q: (0, [(64, 192)])})
    assert "tensor_parallel_size" in info.value.hint and "quantize" in info.value.hint
    assert reader.read({q: (0, [(128, 256)])})[q].dtype == torch.float8_e4m3fn


def test_under_expert_parallelism_a_rank_reads_only_its_experts(checkpoints):
    """A cut of the stacked experts by expert reads those experts' fp8 tensors and
    block scales, as stored, and nothing of the others."""
    from kiln.models import deepseek_v3_checkpoint as ds
    from tests.parallel.read_bytes import count_reads

    root = checkpoints[0] / "deepseek_v3_fp8"
    whole, _ = ds.load_checkpoint(root, torch.float32, keep_fp8=True)
    meta, _ = ds.load_checkpoint(root, torch.float32, keep_fp8=True, weights=False)
    experts = "model.layers.0.mlp.experts."
    wanted = {experts + n: (0, [(4, 8)]) for n in ("down_proj", "down_proj_scale_inv")}
    with count_reads() as counted:
        got = ds.rank_reader(meta, root, "cpu").read(wanted)
    for name in wanted:
        assert torch.equal(got[name].float(), whole.get_parameter(name)[4:].float())
    assert set(counted["by_name"]) == {f"{experts}{e}.down_proj.{w}" for e in range(4, 8)
                                      for w in ("weight", "weight_scale_inv")}
    assert counted["bytes"] == 4 * (64 * 256 + 1 * 2 * 4)  # e4m3 bytes, fp32 scales


def test_quantised_and_dequantised_slices_are_the_whole_model_s(checkpoints):
    """quantize="fp8": a rank's slices in whole blocks quantise as the whole weight
    does, and its heads' W_UK / W_UV come from the whole blocks around their kv_b_proj
    rows. An fp8 checkpoint dequantised (keep_fp8=False) is dequantised slice by slice,
    cuts through blocks included."""
    from kiln.models import deepseek_v3_checkpoint as ds
    from kiln.models.fp8 import quantize_fp8

    root = checkpoints[0]
    attn, experts = "model.layers.0.self_attn.", "model.layers.0.mlp.experts."
    cuts = {attn + "w_uk": (0, [(1, 3)]), attn + "w_uv": (0, [(1, 3)]),  # rows 64:192
            attn + "q_b_proj.weight": (0, [(256, 512)]),
            attn + "q_b_proj.weight_scale_inv": (0, [(2, 4)]),
            experts + "gate_proj": (1, [(128, 256)]),
            experts + "gate_proj_scale_inv": (1, [(1, 2)])}
    whole, _ = ds.load_checkpoint(root / "deepseek_v3", torch.float32)
    quantize_fp8(whole)
    whole.absorb_weights()
    meta, _ = ds.load_checkpoint(root / "deepseek_v3", torch.float32, weights=False)
    got = ds.rank_reader(meta, root / "deepseek_v3", "cpu", quantize=True).read(cuts)
    state = dict(whole.named_parameters()) | dict(whole.named_buffers())
    for name, (axis, ranges) in cuts.items():
        (a, b), = ranges
        assert torch.equal(got[name].float(), state[name].narrow(axis, a, b - a).float()), name

    cuts = {attn + "o_proj.weight": (1, [(32, 96), (160, 224)]),
            attn + "kv_b_proj.weight": (0, [(64, 192)]), attn + "w_uk": (0, [(1, 3)])}
    whole, _ = ds.load_checkpoint(root / "deepseek_v3_fp8", torch.float32)
    meta, _ = ds.load_checkpoint(root / "deepseek_v3_fp8", torch.float32, weights=False)
    got = ds.rank_reader(meta, root / "deepseek_v3_fp8", "cpu").read(cuts)
    state = dict(whole.named_parameters()) | dict(whole.named_buffers())
    for name, (axis, ranges) in cuts.items():
        want = torch.cat([state[name].narrow(axis, a, b - a) for a, b in ranges], axis)
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want), name
