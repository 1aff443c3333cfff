"""fp8 Llama: `quantize="fp8"` at load and fp8 checkpoints in Hugging Face's layout.

The reference is the same model with the fp8 weights dequantised (nn.Linear, fp32):
the only difference left is the activations' per-token fp8 quantisation, so logits
stay within a few percent and greedy choices mostly agree. The compiled LLM runs the
same op as eager (CPU target), and on the interpret target every projection becomes
the generated fp8 kernel.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

import kiln
import kiln.models
from kiln.errors import ArgumentError, CheckpointError, ShapeError
from kiln.ir.plan import RegionKind
from kiln.models import hf
from kiln.models.fp8 import PROJECTIONS, Fp8Linear, quantize_fp8
from kiln.models.llama import PRESETS, example_inputs
from kiln.ops import quantize_weight
from kiln.ops.fp8_linear import dequantize_weight
from tests.helpers import rel_err
from tests.models.support import make_checkpoint

TINY = PRESETS["tiny"].with_(max_seq_len=64)


def _dequantised_twin(fp8_model):
    """The preset model (same seed) whose projections hold fp8_model's weights, dequantised."""
    ref = hf.random_model(TINY, torch.float32, "cpu", 0)
    for layer, fp8_layer in zip(ref.model.layers, fp8_model.model.layers):
        for part, fp8_part in ((layer.self_attn, fp8_layer.self_attn), (layer.mlp, fp8_layer.mlp)):
            for name in PROJECTIONS:
                if hasattr(part, name):
                    q = getattr(fp8_part, name)
                    getattr(part, name).weight.data = dequantize_weight(q.weight,
                                                                        q.weight_scale_inv)
    return ref


def test_quantize_fp8_at_load_close_to_the_dequantised_model():
    llm = kiln.models.load("tiny", quantize="fp8", max_seq_len=64)
    layer = llm.model.model.layers[0]
    assert all(isinstance(getattr(p, n), Fp8Linear) for p, n in
               [(layer.self_attn, "q_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "down_proj")])
    assert layer.self_attn.q_proj.weight.dtype == torch.float8_e4m3fn
    assert llm.model.lm_head.weight.dtype == torch.float32  # head and embedding stay
    assert llm.model.model.embed_tokens.weight.dtype == torch.float32

    prompt = [1, 5, 9, 3]
    ids = llm.generate(prompt, max_new_tokens=16).ids
    seq = torch.tensor(prompt + list(ids))[None]
    pos = torch.arange(seq.shape[1])
    fp8_model = quantize_fp8(hf.random_model(TINY, torch.float32, "cpu", 0))
    ref = _dequantised_twin(fp8_model)
    with torch.no_grad():
        eager, want = fp8_model(seq, pos), ref(seq, pos)
    assert rel_err(llm.forward(seq, pos), eager) <= 1e-5  # compiled = eager fp8
    assert rel_err(eager, want) <= 5e-2
    greedy = eager[0, len(prompt) - 1:-1].argmax(-1)
    assert torch.equal(greedy, seq[0, len(prompt):])  # the compiled LLM's own choices
    agree = (eager.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.8, agree


def test_fp8_llama_on_interpret_runs_the_generated_kernel_in_every_projection():
    cfg = TINY.with_(n_layers=1, max_seq_len=32)
    model = quantize_fp8(hf.random_model(cfg, torch.float32, "cpu", 0))
    args, _ = example_inputs(cfg, seq_len=5)
    exe = kiln.compile(model, args, target="interpret")
    extern = [r for r in exe.program.plan.regions if r.kind == RegionKind.EXTERN]
    assert len(extern) == len(PROJECTIONS)
    assert all(type(exe.program.kplan.kernels[r.name]).__name__ == "TritonKernel"
               for r in extern)
    with torch.no_grad():
        assert rel_err(exe(*args), model(*args)) <= 1e-5


def test_fp8_llama_decode_groups_qkv_and_pairs_gate_up_on_gpus():
    """At one token (a decode step at batch 1) on a GPU target: q, k and v in one
    grouped fp8 GEMV, gate and up paired with the SiLU product (dispatch/
    group_fp8_siblings.py; numerics: tests/codegen/test_grouped_fp8_gemv.py)."""
    from kiln.dispatch.group_siblings import products

    cfg = TINY.with_(n_layers=1, max_seq_len=32)
    model = quantize_fp8(hf.random_model(cfg, torch.float32, "cpu", 0))
    args, _ = example_inputs(cfg, seq_len=1)
    plan = kiln.compile(model, args, target="cuda:sm_90", compile_to="dispatch")
    extern = [r for r in plan.regions if r.kind == RegionKind.EXTERN]
    assert sorted((len(products(r)), len(r.outputs)) for r in extern) == [
        (1, 1), (1, 1), (2, 1), (3, 3)]  # o, down; gate / up; q / k / v


def _make_fp8_checkpoint(path, keep=()):
    """A tiny transformers Llama saved, then rewritten as HF's fp8 layout (e4m3 weight +
    weight_scale_inv per projection, quantization_config quant_method fp8); the
    transformers model with those weights dequantised."""
    model = make_checkpoint(path, "llama3.1")
    for f in list(path.glob("*.safetensors")) + list(path.glob("*.index.json")):
        f.unlink()
    tensors = {}
    for name, p in model.state_dict().items():
        if name.rsplit(".", 2)[-2] in PROJECTIONS and name.endswith(".weight") and \
                not any(k in name for k in keep):
            q, s = quantize_weight(p)
            tensors[name], tensors[name + "_scale_inv"] = q, s
            p.copy_(dequantize_weight(q, s))
        else:
            tensors[name] = p.contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    if keep:
        cfg["quantization_config"]["modules_to_not_convert"] = list(keep)
    (path / "config.json").write_text(json.dumps(cfg))
    return model, tensors


def test_an_fp8_checkpoint_loads_as_it_is(tmp_path, monkeypatch):
    hf_model, tensors = _make_fp8_checkpoint(tmp_path / "fp8")
    model, _ = hf.load_checkpoint(tmp_path / "fp8", torch.float32)
    q_proj = model.model.layers[1].self_attn.q_proj
    assert isinstance(q_proj, Fp8Linear)
    assert torch.equal(q_proj.weight.view(torch.uint8),
                       tensors["model.layers.1.self_attn.q_proj.weight"].view(torch.uint8))
    assert torch.equal(q_proj.weight_scale_inv,
                       tensors["model.layers.1.self_attn.q_proj.weight_scale_inv"])
    tokens = torch.tensor([[1, 7, 20, 33, 4, 60]])
    model.setup_cache()
    with torch.no_grad():
        got = model(tokens, torch.arange(6))
        want = hf_model(tokens).logits
    # the activations' quantisation only: 6.3% here (hidden 64, 2 layers, 14 products)
    assert rel_err(got, want) <= 8e-2
    monkeypatch.setattr(Fp8Linear, "forward", lambda self, x: x @ dequantize_weight(
        self.weight, self.weight_scale_inv).t())
    with torch.no_grad():  # every tensor loaded as transformers holds it
        assert rel_err(model(tokens, torch.arange(6)), want) <= 1e-5

    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    for change, message in ((dict(weight_block_size=[64, 64]), "64x64 blocks"),
                            (dict(activation_scheme="static"), "activation scheme")):
        bad = {**cfg, "quantization_config": {**cfg["quantization_config"], **change}}
        (tmp_path / "fp8" / "config.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=message):
            hf.load_checkpoint(tmp_path / "fp8")


def test_llama_fp8_checkpoints_load_as_fp8_only(tmp_path):
    """Nothing dequantises a Llama fp8 checkpoint: keep_fp8=False says so, True is a
    no-op for it and an error for a checkpoint without fp8 weights."""
    _make_fp8_checkpoint(tmp_path / "fp8")
    with pytest.raises(ArgumentError, match="load as fp8 only"):
        hf.load_checkpoint(tmp_path / "fp8", keep_fp8=False)
    model, _ = hf.load_checkpoint(tmp_path / "fp8", keep_fp8=True)
    assert isinstance(model.model.layers[0].self_attn.k_proj, Fp8Linear)
    make_checkpoint(tmp_path / "plain", "llama3.1")
    with pytest.raises(ArgumentError, match="has no fp8 weights"):
        hf.load_checkpoint(tmp_path / "plain", keep_fp8=True)


def test_random_weights_follow_an_fp8_config(tmp_path):
    _make_fp8_checkpoint(tmp_path / "fp8")
    llm = kiln.models.load(tmp_path / "fp8", random_weights=True, max_seq_len=32)
    assert isinstance(llm.model.model.layers[0].mlp.up_proj, Fp8Linear)
    assert len(llm.generate([1, 2, 3], max_new_tokens=3, ignore_eos=True).ids) == 3


def test_modules_not_converted_stay_real(tmp_path):
    """HF's modules_to_not_convert: those projections are stored in bf16/fp32 and load
    as nn.Linear; the rest as fp8."""
    _make_fp8_checkpoint(tmp_path / "fp8", keep=("layers.0.mlp",))
    model, _ = hf.load_checkpoint(tmp_path / "fp8", torch.float32)
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert isinstance(model.model.layers[0].self_attn.q_proj, Fp8Linear)
    assert isinstance(model.model.layers[1].mlp.down_proj, Fp8Linear)


def test_bad_quantize_requests_are_refused_before_compiling():
    with pytest.raises(ArgumentError, match="unknown quantization 'int4'"):
        kiln.models.load("tiny", quantize="int4")



def test_quantize_under_tensor_parallelism_that_cuts_a_block_is_a_shape_error():
    """The tiny preset's 64-wide projections cannot be cut in two without cutting
    their 128 x 128 scale blocks: the plan says so, naming the projection (splits that
    keep whole blocks run: tests/parallel/test_rank_weights.py)."""
    with pytest.raises(ShapeError, match=r"tensor parallelism over 2 ranks would cut this "
                       r"fp8 projection's \d+ output features into 2 parts of \d+, through "
                       r"its 128x128 scale blocks") as info:
        kiln.models.load("tiny", quantize="fp8", tensor_parallel_size=2)
    assert "quantize='fp8'" in info.value.hint
    # the failed load leaves this process no rank: no process group, no torchrun variables
    import os

    import torch.distributed as dist
    assert not dist.is_initialized() and "RANK" not in os.environ


def test_cli_takes_quantize_fp8():
    from kiln.cli.args import build_parser

    args = build_parser().parse_args(["generate", "--random-weights", "--config", "tiny",
                                      "--quantize", "fp8", "--prompt-ids", "1,2"])
    assert args.quantize == "fp8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--config", "tiny", "--quantize", "int8"])


def test_a_rank_reads_an_fp8_checkpoint_as_stored(tmp_path):
    """A multi-device load builds the model on the meta device in the fp8 layout and
    each rank reads its fp8 bytes and block scales as stored (whole here: 64-wide
    projections have one block; cuts: tests/parallel/test_rank_weights.py)."""
    _make_fp8_checkpoint(tmp_path / "fp8")
    whole, _ = hf.load_checkpoint(tmp_path / "fp8", torch.float32)
    meta, _ = hf.load_checkpoint(tmp_path / "fp8", torch.float32, weights=False)
    q = "model.layers.1.self_attn.q_proj."
    assert meta.get_parameter(q + "weight").dtype == torch.float8_e4m3fn
    wanted = {q + "weight": None, q + "weight_scale_inv": None, "lm_head.weight": (0, [(0, 8)])}
    got = hf.rank_reader(meta, tmp_path / "fp8", "cpu").read(wanted)
    assert got[q + "weight"].dtype == torch.float8_e4m3fn
    for name, cut in wanted.items():
        want = whole.get_parameter(name)
        want = want if cut is None else want[:8]
        assert torch.equal(got[name].float(), want.float()), name
