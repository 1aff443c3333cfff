"""The gated delta rule's generated kernel on a CUDA GPU, at forced configs of both forms.

The interpret target checks the kernels' logic on tiny shapes; this checks what the GPU
compiler makes of them at widths the models use (K = V = 128, several 64-row key blocks,
16-bit dots on tensor cores): odd T over several chunks with a masked tail, two batch
rows, value heads = 2 x key heads, an initial and the final state, packed sequences,
against the step-by-step recurrence in fp64 (bf16 inputs: 2e-2, as the seed's fp32
comparison in benchmarks/gated_delta_rule.py).
"""

import pytest
import torch

import kiln
from kiln.codegen.build.compiler import compile_binary
from kiln.codegen.build.spec import Config
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.codegen.templates.gated_delta import template as gated_delta
from kiln.ir.plan import RegionKind
from kiln.ops import gated_delta_rule
from kiln.target import get_target
from tests.helpers import rel_err
from tests.ops.test_gated_delta_rule import inputs, reference

pytestmark = pytest.mark.gpu


class Delta(torch.nn.Module):
    def forward(self, q, k, v, g, beta, state):
        return gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)


class Packed(torch.nn.Module):
    def forward(self, q, k, v, g, beta, state, cu):
        return gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                cu_seqlens=cu)


def _bf16(args):
    q, k, v, g, beta, *rest = args
    return (q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), *rest)


def _run_at(module, args, config):
    """The op's region compiled for this GPU and launched at `config` (twice: the counters
    and flags must be zero again after a launch); its outputs, o first."""
    cuda = tuple(a.cuda() for a in args)
    plan = kiln.compile(module, cuda, compile_to="dispatch")
    (region,) = [r for r in plan.regions if r.kind == RegionKind.EXTERN]
    target = get_target("cuda")
    spec = gated_delta.generate(region, plan, target)
    assert config in spec.configs
    kernel = TritonKernel(region, spec, config, compile_binary(spec, config, target))
    named = dict(zip(region.inputs, cuda))
    for _ in range(2):
        outs = {o: torch.full(tuple(int(d) for d in plan.values[o].shape), float("nan"),
                              dtype=plan.values[o].dtype, device="cuda")
                for o in region.outputs}
        kernel.run(named, outs, {})
    o, final = sorted(outs.values(), key=lambda t: t.dim() != args[0].dim())
    return o.float().cpu(), final.float().cpu()


@pytest.mark.parametrize("chunk,bv,warps,stages,staged", [
    (64, 64, 4, 2, 1), (64, 32, 4, 2, 1), (64, 64, 8, 2, 1), (32, 128, 4, 1, 1),
    (64, 32, 4, 1, 1), (64, 128, 8, 2, 1), (32, 64, 4, 2, 0), (16, 32, 8, 1, 0)])
def test_both_forms_match_the_recurrence_at_model_widths(chunk, bv, warps, stages, staged):
    H, HV, K, V = 2, 4, 128, 128
    q, k, v, g, beta = inputs(2, 157, H, HV, K, V, seed=3)
    state = torch.randn(2, HV, K, V)
    args = _bf16((q, k, v, g, beta, state))
    o, final = _run_at(Delta(), args, Config.make(warps, stages, CHUNK=chunk, BV=bv,
                                                   STAGED=staged))
    ref_o, ref_s = reference(*(a.float() for a in args[:5]), K ** -0.5, state)
    assert rel_err(o, ref_o) <= 2e-2 and rel_err(final, ref_s) <= 2e-2


def test_packed_sequences_from_their_own_states():
    H, HV, K, V = 1, 2, 128, 128
    lengths = [70, 1, 129]
    cu = torch.tensor([0, 70, 71, 200], dtype=torch.int32)
    q, k, v, g, beta = inputs(1, 200, H, HV, K, V, seed=5)
    state = torch.randn(len(lengths), HV, K, V)
    args = _bf16((q, k, v, g, beta, state)) + (cu,)
    o, final = _run_at(Packed(), args, Config.make(4, 2, CHUNK=64, BV=64, STAGED=1))
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        piece = [x[:, a:b].float() for x in args[:5]]
        ref_o, ref_s = reference(*piece, K ** -0.5, state[n:n + 1])
        assert rel_err(o[:, a:b], ref_o) <= 2e-2 and rel_err(final[n:n + 1], ref_s) <= 2e-2


def test_a_compiled_module_prefills_and_decodes_as_its_pytorch_form():
    """kiln.compile's own choice (tuning off) for a dynamic T and a decode step."""
    H, HV, K, V = 2, 4, 128, 128
    q, k, v, g, beta = inputs(1, 300, H, HV, K, V, seed=7)
    state = torch.randn(1, HV, K, V)
    args = tuple(a.cuda() for a in _bf16((q, k, v, g, beta, state)))
    dim = kiln.Dim("T", min=1, max=512)
    exe = kiln.compile(Delta(), args, target="cuda", options={"tune": "none"},
                       dynamic_shapes=({1: dim},) * 5 + (None,))
    for t in (300, 1):
        part = tuple(a[:, :t].contiguous() for a in args[:5]) + (args[5],)
        o, final = exe(*part)
        ref_o, ref_s = reference(*(a.float().cpu() for a in part[:5]), K ** -0.5, state)
        assert rel_err(o.float().cpu(), ref_o) <= 2e-2
        assert rel_err(final.float().cpu(), ref_s) <= 2e-2
