"""Compile-only guards of the fast paths on Hopper (no GPU needed): the SASS of the
sm_90 kernels shows what the templates were shaped for. A tiled fp16/bf16 matmul and
prefill attention run on wgmma (HGMMA) fed by cp.async (LDGSTS), the decode GEMV
streams its weights as 16-byte loads (LDG.E.128), and nothing lives in local memory.
The split forms also compile within the limits of sm_80 and gfx942."""

import re

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.codegen.build.compiler import compile_binary, disassemble
from kiln.codegen.build.spec import Config
from kiln.codegen.templates.attention import template as attention
from kiln.codegen.templates.matmul import template as matmul
from kiln.ir.plan import RegionKind
from kiln.target import get_target

SM90 = get_target("cuda:sm_90")


class Linear(torch.nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.lin = torch.nn.Linear(k, n, bias=False)

    def forward(self, x):
        return self.lin(x)


class Causal(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _spec(model, args, target=SM90):
    plan = kiln.compile(model, args, compile_to="dispatch")
    (region,) = [r for r in plan.regions if r.kind in (RegionKind.MATMUL,
                                                        RegionKind.ATTENTION)]
    gen = matmul.generate if region.kind == RegionKind.MATMUL else attention.generate
    return gen(region, plan, target)


def _sass(spec, config):
    binary = compile_binary(spec, config, SM90)
    sass = disassemble(binary)
    if sass is None:
        pytest.skip("Triton ships no cuobjdump here")
    assert binary.resources.spills == 0
    assert not re.search(r"\b(LDL|STL)\b", sass), "registers spilled to local memory"
    return sass


def _count(sass: str, op: str) -> int:
    return len(re.findall(rf"\b{re.escape(op)}\b", sass))


@pytest.mark.parametrize("dtype,config", [
    (torch.float16, Config.make(4, 4, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8,
                                SPLIT_K=1)),
    (torch.bfloat16, Config.make(8, 3, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8,
                                 SPLIT_K=8)),
])
def test_sm90_half_matmul_runs_on_wgmma_fed_by_cp_async(dtype, config):
    spec = _spec(Linear(512, 256).to(dtype), (torch.randn(1, 256, 512, dtype=dtype),))
    assert spec.meta["form"] == "tiled"
    assert "mask=" not in spec.source.split("for k0")[1].split("rm2 =")[0]  # even K
    sass = _sass(spec, config)
    assert "HGMMA.64x128x16.F32" in sass and "HMMA" not in sass
    assert "LDGSTS.E.BYPASS.128" in sass  # 16-byte async copies into shared memory


def test_sm90_gemv_streams_16_byte_weight_vectors():
    spec = _spec(Linear(4096, 1024).half(), (torch.randn(1, 1, 4096).half(),))
    assert spec.meta["form"] == "gemv"
    config = spec.default
    sass = _sass(spec, config)
    per_thread = config["BLOCK_K"] * config["BLOCK_N"] * 2 // 16 // (32 * config.num_warps)
    assert _count(sass, "LDG.E.128") >= per_thread  # the weight tile, 16 bytes a load
    assert _count(sass, "LDG.E.U16") <= 1  # at most the activation row, never the weights


def test_sm90_prefill_attention_runs_on_wgmma():
    h = torch.float16
    q, k = torch.randn(1, 8, 256, 128, dtype=h), torch.randn(1, 2, 256, 128, dtype=h)
    spec = _spec(Causal(), (q, k, k.clone()))
    sass = _sass(spec, Config.make(8, 2, BLOCK_M=128, BLOCK_N=64, KV_SPLIT=32))
    assert "HGMMA.64x64x16.F32" in sass and "LDGSTS.E.BYPASS.128" in sass


@pytest.mark.parametrize("target", ["cuda:sm_80", "rocm:gfx942"])
def test_split_forms_compile_within_other_targets(target):
    tgt = get_target(target)
    h = torch.float16
    cases = [
        (_spec(Linear(512, 256).half(), (torch.randn(1, 64, 512, dtype=h),), tgt),
         Config.make(4, 2, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, SPLIT_K=8)),
        (_spec(Linear(512, 256).half(), (torch.randn(1, 1, 512, dtype=h),), tgt),
         Config.make(4, 1, BLOCK_N=64, BLOCK_K=128, SPLIT_K=16)),
        (_spec(Causal(), (torch.randn(1, 8, 1, 128, dtype=h),
                          *[torch.randn(1, 2, 64, 128, dtype=h)] * 2), tgt),
         Config.make(4, 1, BLOCK_M=16, BLOCK_N=32, KV_SPLIT=32)),
    ]
    for spec, config in cases:
        res = compile_binary(spec, config, tgt).resources
        assert res.shared <= tgt.shared_mem_per_block and res.spills in (None, 0), spec.name
