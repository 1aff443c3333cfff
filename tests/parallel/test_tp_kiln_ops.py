"""Tensor parallelism through kiln's own ops: DeepSeek-V3 (latent attention, routed
experts), Qwen3-Next (gated delta rule, routed experts) and block-scaled fp8 linears.

One gloo run of two ranks checks the models end to end (checkpoints made by
transformers, each rank loading its LLM with tensor_parallel_size=2) against the same
model run whole; the plans of one rank (no processes) check the cuts and the errors.
"""

from __future__ import annotations

import re

import pytest
import torch

import kiln
from kiln.errors import ArgumentError, ShapeError
from kiln.models.moe import use_expert_parallel
from tests.helpers import rel_err
from tests.parallel.spmd import run_spmd

pytestmark = pytest.mark.filterwarnings("ignore")
transformers = pytest.importorskip("transformers")


def _weight_bytes(module) -> float:
    """The `weights:` figure of `kiln explain`, in KiB."""
    line = next(s for s in module.explain().splitlines() if "weights:" in s)
    value, unit = re.search(r"([\d.]+) (B|KiB|MiB)$", line).groups()
    return float(value) * {"B": 1 / 1024, "KiB": 1, "MiB": 1024}[unit]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.models.test_deepseek_v3 import make_hf_model
    from tests.models.test_qwen3_next import CONFIG

    root = tmp_path_factory.mktemp("tp_kiln_ops")
    make_hf_model().save_pretrained(str(root / "deepseek_v3"))
    torch.manual_seed(0)
    qwen = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**CONFIG)).eval()
    with torch.no_grad():
        for name, p in qwen.named_parameters():
            if "norm" in name:
                p.normal_(1.0 if name.endswith("linear_attn.norm.weight") else 0.0, 0.1)
    qwen.save_pretrained(str(root / "qwen3_next"))
    # a shared expert as wide as a routed one (Qwen3-Next-80B's): one more gathered expert
    torch.manual_seed(1)
    shared = dict(CONFIG, shared_expert_intermediate_size=CONFIG["moe_intermediate_size"])
    qwen = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**shared)).eval()
    qwen.save_pretrained(str(root / "qwen3_next_shared"))
    return {"deepseek_v3": str(root / "deepseek_v3"), "qwen3_next": str(root / "qwen3_next"),
            "qwen3_next_shared": str(root / "qwen3_next_shared")}


def _load(path):
    from kiln.models import deepseek_v3_checkpoint, hf

    loader = deepseek_v3_checkpoint if path.endswith("deepseek_v3") else hf
    model, _ = loader.load_checkpoint(path, torch.float32, max_seq_len=32)
    model.setup_cache()
    return model


def _fp8_mlp():
    from kiln.models.fp8 import Fp8Linear

    torch.manual_seed(4)
    up = Fp8Linear.from_linear(torch.nn.Linear(256, 512, bias=False))
    down = Fp8Linear.from_linear(torch.nn.Linear(512, 256, bias=False))
    return torch.nn.Sequential(up, torch.nn.SiLU(), down)


def _held(modules, eager) -> dict:
    """This rank's tensors of the model (shapes, bytes), the same tensors' bytes whole,
    and its weight bytes as `kiln explain` prints them (KiB, caches included)."""
    whole = dict(eager.named_parameters()) | dict(eager.named_buffers())
    held = {n: t for m in modules for n, t in m.state.items() if n in whole}
    return dict(shapes={n: tuple(t.shape) for n, t in held.items()},
                held=sum(t.nbytes for t in held.values()),
                whole=sum(whole[n].nbytes for n in held),
                explain_kib=[_weight_bytes(m) for m in modules])


def _ranks(rank, world, paths):
    """The largest error of each model's logits over a prefill and decode steps (through
    the cache or recurrent state the prefill left) against the model run whole, and
    what this rank holds. DeepSeek-V3: one module for every T, kiln::latent_attention
    over the cache, the experts cut by expert. Qwen3-Next: the LLM kiln.models.load
    makes (built on the meta device, each rank reading its slices of the checkpoint;
    a prefill module with kiln::moe_experts, a decode one gathering the chosen experts'
    weights, both cut by each expert's width)."""
    import kiln.models

    out = {}
    tokens = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(5))
    steps = ((0, 7), (7, 8), (8, 9), (9, 10))
    model, eager = _load(paths["deepseek_v3"]), _load(paths["deepseek_v3"])
    model.use_forms("absorbed")
    eager.use_forms("absorbed")
    use_expert_parallel(model)  # its 8 experts: 4 per rank
    seq = torch.export.Dim("seq", min=1, max=16)
    module = kiln.compile(model, (tokens[:, :4], torch.arange(4)[None]),
                          dynamic_shapes=({1: seq}, {1: seq}), parallel={"tp": world})
    with torch.no_grad():
        err = max(rel_err(module(tokens[:, a:b], torch.arange(a, b)[None]),
                          eager(tokens[:, a:b], torch.arange(a, b)[None])) for a, b in steps)
    out["deepseek_v3"] = dict(err=err, **_held([module], eager))
    for family in ("qwen3_next", "qwen3_next_shared"):
        llm = kiln.models.load(paths[family], dtype=torch.float32, max_seq_len=32,
                               tensor_parallel_size=world)
        eager = _load(paths[family])
        with torch.no_grad():
            err = max(rel_err(llm.forward(tokens[:, a:b], torch.arange(a, b)[None]),
                              eager(tokens[:, a:b], torch.arange(a, b)[None]))
                      for a, b in steps)
        out[family] = dict(err=err, **_held([llm.prefill_module, llm.decode_module], eager))
    mlp = _fp8_mlp()
    x = torch.randn(1, 80, 256)
    module = kiln.compile(mlp, (x,), dynamic_shapes=({1: torch.export.Dim("rows", max=128)},),
                          parallel={"tp": world})
    with torch.no_grad():  # 80 rows: fp8 quantize + scaled mm; 1 row: the whole linear
        out["fp8"] = max(rel_err(module(x[:, :n]), mlp(x[:, :n])) for n in (80, 1))
    return out


def test_deepseek_v3_qwen3_next_and_fp8_tp2_match_one_device(checkpoints):
    for out in run_spmd(_ranks, 2, checkpoints, timeout=400):
        for family in ("deepseek_v3", "qwen3_next", "qwen3_next_shared"):
            got = out[family]
            assert got["err"] <= 1e-5, (family, got["err"])
            assert got["held"] < 0.75 * got["whole"], got  # norms, router, caches whole
        ds = out["deepseek_v3"]["shapes"]
        attn, experts = "model.layers.1.self_attn.", "model.layers.1.mlp.experts."
        assert ds[attn + "w_uk"] == (2, 32, 16) and ds[attn + "w_uv"] == (2, 16, 32)
        assert ds[attn + "q_b_proj.weight"] == (2 * 24, 48)
        assert ds[attn + "q_a_proj.weight"] == (48, 64)  # seeded whole
        assert ds[attn + "kv_a_proj_with_mqa.weight"] == (40, 64)
        assert ds[attn + "latent_cache.latent_cache"] == (1, 32, 40)  # read by every head
        assert ds[experts + "gate_proj"] == (4, 32, 64)  # by expert
        qn = out["qwen3_next"]["shapes"]
        assert qn["model.layers.0.linear_attn.state.recurrent"] == (1, 2, 16, 8)
        assert qn["model.layers.0.linear_attn.conv1d.weight"] == (48, 1, 4)
        assert qn["model.layers.0.mlp.experts.up_proj"] == (4, 16, 64)  # by width
        assert out["fp8"] <= 1e-5, out["fp8"]


# ---- one rank's plan -------------------------------------------------------------------


def _plan(model, tp, rank=0, seq_len=4):
    args = (torch.zeros(1, seq_len, dtype=torch.long), torch.arange(seq_len)[None])
    return kiln.compile(model, args, compile_to="parallel", parallel={"tp": tp, "rank": rank})


def _shapes(kg) -> dict[str, tuple]:
    return {i.target: tuple(n.meta["val"].shape) for i, n in
            zip(kg.inputs, (n for n in kg.graph.nodes if n.op == "placeholder"))
            if i.target is not None}


def _collectives(kg) -> list[str]:
    return sorted(str(n.target) for n in kg.graph.nodes if "kiln.all_" in str(n.target))


def _tiny_deepseek(**overrides):
    from kiln.models.deepseek_v3 import DeepseekV3Config
    from kiln.models.deepseek_v3_checkpoint import random_model

    cfg = DeepseekV3Config(vocab_size=128, dim=64, n_layers=1, n_heads=4, q_lora_rank=48,
                           kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                           v_head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                           n_routed_experts=8, n_experts_per_tok=2, n_group=4, topk_group=2,
                           first_k_dense_replace=0, max_seq_len=32).with_(**overrides)
    model = random_model(cfg)
    model.setup_cache()
    return model


def test_expanded_latent_attention_is_cut_by_heads():
    """Prefill's form: kv_b_proj (a linear over the cache, a bmm) expands every head's
    keys and values: cut by heads like q_b_proj; the latent itself stays whole."""
    model = _tiny_deepseek()
    kg = _plan(model, 2, rank=1, seq_len=4)
    shapes = _shapes(kg)
    attn = "model.layers.0.self_attn."
    assert shapes[attn + "kv_b_proj.weight"] == (2 * 32, 32)
    full = model.model.layers[0].self_attn.kv_b_proj.weight
    assert torch.equal(kg.state[attn + "kv_b_proj.weight"], full[64:])
    assert attn + "w_uk" not in shapes  # decode's absorbed weights: unread here, not held
    assert shapes[attn + "kv_a_proj_with_mqa.weight"] == (40, 64)
    # embedding, o_proj, routed + shared experts summed before one; the logits
    assert _collectives(kg) == ["kiln.all_gather.default"] + ["kiln.all_reduce.default"] * 3


def test_gated_delta_rule_is_cut_by_heads_with_its_state():
    from kiln.models.hf import random_model
    from kiln.models.qwen3_next import Qwen3NextConfig

    cfg = Qwen3NextConfig(vocab_size=128, dim=64, n_layers=1,
                          layer_types=("linear_attention",), n_heads=4, n_kv_heads=2,
                          head_dim=16, linear_k_heads=2, linear_v_heads=4, linear_k_dim=16,
                          linear_v_dim=8, n_experts=4, experts_per_token=2,
                          moe_intermediate_size=32, shared_expert_intermediate_size=48,
                          max_seq_len=32)
    model = random_model(cfg)
    model.setup_cache()
    kg = _plan(model, 2, rank=1)
    shapes = _shapes(kg)
    la = "model.layers.0.linear_attn."
    assert shapes[la + "in_proj_qkvz.weight"] == (64, 64)  # packed per key head: one block
    assert shapes[la + "conv1d.weight"] == (48, 1, 4)
    assert shapes[la + "state.recurrent"] == (1, 2, 16, 8)
    assert shapes[la + "state.conv"] == (1, 3, 48)
    assert shapes[la + "out_proj.weight"] == (64, 16)
    # the conv's channels are [q | k | v]: rank 1 holds the second half of each
    conv = model.model.layers[0].linear_attn.conv1d.weight
    want = torch.cat([conv[16:32], conv[48:64], conv[80:96]])
    assert torch.equal(kg.state[la + "conv1d.weight"], want)
    # no gather inside the layer: the embedding, out_proj, the experts' sum, the logits
    assert _collectives(kg) == ["kiln.all_gather.default"] + ["kiln.all_reduce.default"] * 3


def test_fp8_blocks_cut_whole_or_refused():
    mlp = _fp8_mlp()
    x = torch.randn(1, 4, 256)
    kg = kiln.compile(mlp, (x,), compile_to="parallel", parallel={"tp": 2, "rank": 1})
    state = kg.state
    assert tuple(state["0.weight"].shape) == (256, 256)
    assert tuple(state["0.weight_scale_inv"].shape) == (2, 2)  # its 128-row blocks
    assert torch.equal(state["0.weight_scale_inv"], mlp[0].weight_scale_inv[2:])
    assert tuple(state["2.weight"].shape) == (256, 256)  # row parallel: K halved
    assert torch.equal(state["2.weight_scale_inv"], mlp[2].weight_scale_inv[:, 2:])
    with pytest.raises(ShapeError, match=r"512 output features into 8 parts of 64, through "
                       r"its 128x128 scale blocks") as info:
        kiln.compile(mlp, (x,), compile_to="parallel", parallel={"tp": 8, "rank": 0})
    assert "tp in [1, 2, 4]" in str(info.value)


def test_fp8_experts_cut_by_width_in_whole_blocks_or_by_expert():
    """kiln::moe_experts_fp8 is cut like kiln::moe_experts, each weight's block scales
    with it; a width cut through a 128-block is refused, naming the experts."""
    from kiln.models.moe import quantize_experts_fp8

    model = _tiny_deepseek(moe_intermediate_size=256)
    quantize_experts_fp8(model)
    experts = "model.layers.0.mlp.experts."
    shapes = _shapes(_plan(model, 2, rank=1))
    assert shapes[experts + "gate_proj"] == (8, 128, 64)  # each expert's width halved
    assert shapes[experts + "gate_proj_scale_inv"] == (8, 1, 1)
    assert shapes[experts + "down_proj"] == (8, 64, 128)
    assert shapes[experts + "down_proj_scale_inv"] == (8, 1, 1)
    use_expert_parallel(model)
    kg = _plan(model, 2, rank=1)
    shapes = _shapes(kg)
    assert shapes[experts + "up_proj"] == (4, 256, 64)  # by expert: the last 4
    assert shapes[experts + "up_proj_scale_inv"] == (4, 2, 1)
    whole = model.model.layers[0].mlp.experts.up_proj_scale_inv
    assert torch.equal(kg.state[experts + "up_proj_scale_inv"], whole[4:])
    narrow = _tiny_deepseek(moe_intermediate_size=128)
    quantize_experts_fp8(narrow)
    with pytest.raises(ShapeError, match="experts' intermediate features into 2 parts of 64"):
        _plan(narrow, 2)


@pytest.mark.parametrize("overrides,tp,match", [
    ({"moe_intermediate_size": 48}, 3, "4 .heads or width. is not divisible by 3"),  # heads
    ({"n_heads": 6, "moe_intermediate_size": 40}, 3,
     r"experts.gate_proj \[8, 40, 64\] along axis 1: 40 not divisible by 3"),
])
def test_tp_that_does_not_divide_heads_or_experts_is_a_clear_error(overrides, tp, match):
    with pytest.raises(ShapeError, match=match):
        _plan(_tiny_deepseek(**overrides), tp)


class _Seeded(torch.nn.Linear):
    def __init__(self, spec):
        super().__init__(64, 32, bias=False)
        self.spec = spec

    def tensor_parallel_seeds(self):
        return {"weight": self.spec}


def test_seeds_cut_up_front_and_a_bad_seed_is_a_clear_error():
    x = torch.randn(2, 64)
    kg = kiln.compile(_Seeded(1), (x,), compile_to="parallel", parallel={"tp": 2, "rank": 1})
    assert tuple(kg.state["weight"].shape) == (32, 32)  # input features: row parallel
    assert _collectives(kg) == ["kiln.all_reduce.default"]
    with pytest.raises(ArgumentError, match="seed of weight names axis 5"):
        kiln.compile(_Seeded(5), (x,), compile_to="parallel", parallel={"tp": 2, "rank": 0})
