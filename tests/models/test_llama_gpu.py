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
    args, dynamic = example_inputs(model.cfg, seq_len=8)
    args = tuple(a.cuda() for a in args)
    exe = kiln.compile(model, args, dynamic_shapes=dynamic, target="cuda")
    pos = 0
    for n in (13, 1, 1, 1):
        tokens = torch.randint(0, model.cfg.vocab_size, (1, n), device="cuda")
        input_pos = torch.arange(pos, pos + n, device="cuda")
        out, ref = exe(tokens, input_pos), eager(tokens, input_pos)
        assert rel_err(out, ref) <= tol, (n, rel_err(out, ref))
        pos += n
