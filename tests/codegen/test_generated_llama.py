"""Issue 3's acceptance for generated kernels on Llama models, without a GPU:

- the tiny Llama compiled for `interpret` runs every pointwise, reduction and copy
  region as a generated Triton kernel and matches eager (prefill, then decode steps);
- every kernel the generators make for the tiny Llama and for a Llama-3-8B-shaped
  decoder layer (head_dim 128, fp16) compiles for sm_90, sm_80 and gfx942 with real
  shared memory within each target's limit.
"""

import copy

import pytest
import torch

import kiln
from kiln.codegen.build.compiler import compile_binary
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.codegen.kernel_plan import KernelPlan
from kiln.codegen.select_kernels import TEMPLATES
from kiln.ir.plan import RegionKind
from kiln.models.llama import PRESETS, Llama, LlamaConfig, example_inputs, tiny_llama
from kiln.target import TARGETS
from tests.helpers import rel_err

GENERATED = (RegionKind.POINTWISE, RegionKind.REDUCTION, RegionKind.COPY)


def test_tiny_llama_runs_generated_kernels_and_matches_eager():
    model = tiny_llama()
    eager = copy.deepcopy(model)
    args, dynamic = example_inputs(model.cfg, seq_len=4)
    exe = kiln.compile(model, args, dynamic_shapes=dynamic, target="interpret")
    kp: KernelPlan = exe.program.kplan
    for r in exe.plan.regions:
        if r.kind in GENERATED:
            assert isinstance(kp.kernels[r.name], TritonKernel), (r.name, r.kind, r.notes)
    pos = 0
    for step in (6, 1, 1):  # a prefill, then two decode steps
        tokens = torch.randint(0, model.cfg.vocab_size, (1, step))
        input_pos = torch.arange(pos, pos + step)
        out, ref = exe(tokens, input_pos), eager(tokens, input_pos)
        assert rel_err(out, ref) <= 1e-5, (step, rel_err(out, ref))
        pos += step
    for a, b in zip(model.buffers(), eager.buffers()):  # the KV cache, written in place
        assert rel_err(a, b) <= 1e-5


def _llama3_8b_layer():
    cfg = LlamaConfig(**{**PRESETS["llama3-8b"].__dict__, "n_layers": 1, "vocab_size": 512})
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = Llama(cfg).to(torch.float16)
        model.setup_cache(torch.float16)
    args, dynamic = example_inputs(cfg, seq_len=8)
    return model, tuple(a.to("meta") for a in args), dynamic


def _tiny():
    model = tiny_llama()
    args, dynamic = example_inputs(model.cfg, seq_len=4)
    return model, args, dynamic


@pytest.mark.parametrize("build", [_tiny, _llama3_8b_layer], ids=["tiny", "llama3-8b-layer"])
def test_generated_kernels_compile_within_target_limits(build):
    model, args, dynamic = build()
    plan = kiln.compile(model, args, dynamic_shapes=dynamic, compile_to="dispatch")
    compiled: dict[tuple, int] = {}
    for name in ("cuda:sm_90", "cuda:sm_80", "rocm:gfx942"):
        target = TARGETS[name]
        for region in plan.regions:
            if region.kind not in GENERATED:
                continue
            spec = TEMPLATES[region.kind](region, plan, target)
            assert spec is not None, (region.name, region.notes)
            key = (spec.source_hash, name)
            if key in compiled:
                continue
            binary = compile_binary(spec, spec.default, target)
            res = binary.resources
            assert res.shared <= target.shared_mem_per_block, (region.name, name, res)
            assert res.threads <= target.max_threads_per_block
            compiled[key] = res.shared
    assert compiled
