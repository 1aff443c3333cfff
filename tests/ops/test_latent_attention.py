"""kiln.ops.latent_attention against the einsum form of absorbed latent attention, written
out here; the contiguous and paged layouts agree; chunks of several queries are causal
by position; torch.export keeps it whole; bad input is refused with kiln's errors."""

import pytest
import torch

import kiln
from kiln.errors import DTypeError, ShapeError
from kiln.ops import latent_attention
from tests.helpers import rel_err


def einsum_reference(q_latent, q_rope, latent, rope, input_pos, scale):
    """Scores over each row's keys [B, S, R + P] by einsum, masked by position, softmax,
    then the weighted latents: the absorbed form as torch ops, in float64."""
    q_latent, q_rope, latent, rope = (x.double() for x in (q_latent, q_rope, latent, rope))
    scores = (torch.einsum("bthr,bsr->bhts", q_latent, latent)
              + torch.einsum("bthp,bsp->bhts", q_rope, rope)) * scale
    keys = torch.arange(latent.shape[1])
    visible = keys[None, None, None, :] <= input_pos[:, None, :, None]
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("bhts,bsr->bthr", weights, latent)


def inputs(B, Sq, H, R, P, S, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q_latent, q_rope = torch.randn(B, Sq, H, R, generator=gen), torch.randn(B, Sq, H, P,
                                                                             generator=gen)
    cache = torch.randn(B, S, R + P, generator=gen)
    return (q_latent.to(dtype), q_rope.to(dtype), cache.to(dtype))


def paged(cache: torch.Tensor, block_size: int, seed: int = 0):
    """The contiguous cache [B, S, W] scattered into a shuffled pool of blocks (block 0
    left unused, as the allocator does): (pool [blocks, block_size, W], block_table)."""
    B, S, W = cache.shape
    per_row = S // block_size
    order = torch.randperm(B * per_row, generator=torch.Generator().manual_seed(seed)) + 1
    table = order.view(B, per_row)
    pool = torch.full((B * per_row + 1, block_size, W), float("nan"), dtype=cache.dtype)
    pool[table] = cache.view(B, per_row, block_size, W)
    return pool, table


@pytest.mark.parametrize("Sq", [1, 3])
def test_equals_the_einsum_form_contiguous_and_paged(Sq):
    B, H, R, P, S = 2, 4, 32, 8, 24
    q_latent, q_rope, cache = inputs(B, Sq, H, R, P, S)
    input_pos = torch.tensor([[5, 6, 7], [17, 18, 19]])[:, :Sq]  # rows of different lengths
    scale = 0.37
    ref = einsum_reference(q_latent, q_rope, cache[..., :R], cache[..., R:], input_pos, scale)
    out = latent_attention(q_latent, q_rope, cache[..., :R], cache[..., R:], input_pos, scale)
    assert out.shape == (B, Sq, H, R) and out.dtype == torch.float32
    assert rel_err(out, ref) <= 1e-5
    pool, table = paged(cache, block_size=4)
    out = latent_attention(q_latent, q_rope, pool[..., :R], pool[..., R:], input_pos, scale,
                           table)
    assert rel_err(out, ref) <= 1e-5  # the pool's NaN rows (block 0) are never read


def test_a_contiguous_cache_with_more_rows_than_the_batch_reads_rows_0_to_b():
    q_latent, q_rope, cache = inputs(1, 1, 2, 16, 8, 12, seed=1)
    spare = torch.cat((cache, torch.full_like(cache, float("nan"))))  # 2 rows, batch 1
    pos = torch.tensor([[9]])
    out = latent_attention(q_latent, q_rope, spare[..., :16], spare[..., 16:], pos, 0.5)
    ref = einsum_reference(q_latent, q_rope, cache[..., :16], cache[..., 16:], pos, 0.5)
    assert rel_err(out, ref) <= 1e-5


def test_export_keeps_one_op_and_the_cpu_target_runs_it():
    class Attend(torch.nn.Module):
        def forward(self, q_latent, q_rope, cache, pos):
            return latent_attention(q_latent, q_rope, cache[..., :16], cache[..., 16:], pos,
                                    0.25)

    args = inputs(2, 1, 4, 16, 8, 10, seed=2) + (torch.tensor([[3], [9]]),)
    ep = torch.export.export(Attend(), args)
    ops = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.kiln.latent_attention.default) == 1
    out = kiln.compile(Attend(), args, target="cpu")(*args)
    assert rel_err(out, Attend()(*args)) == 0


def test_bad_shapes_and_dtypes_are_clear_errors():
    q_latent, q_rope, cache = inputs(2, 1, 4, 16, 8, 10)
    kv, kr = cache[..., :16], cache[..., 16:]
    pos = torch.tensor([[3], [9]])
    with pytest.raises(ShapeError, match="q_latent must be a 4-d"):
        latent_attention(q_latent[0], q_rope, kv, kr, pos, 1.0)
    with pytest.raises(ShapeError, match="widths 12 \\+ 8 differ"):
        latent_attention(q_latent, q_rope, kv[..., :12], kr, pos, 1.0)
    with pytest.raises(ShapeError, match="q_rope has shape"):
        latent_attention(q_latent, q_rope[:, :, :2], kv, kr, pos, 1.0)
    with pytest.raises(ShapeError, match="input_pos has shape"):
        latent_attention(q_latent, q_rope, kv, kr, pos[:1], 1.0)
    with pytest.raises(ShapeError, match="1 rows for a batch of 2"):
        latent_attention(q_latent, q_rope, kv[:1], kr[:1], pos, 1.0)
    with pytest.raises(ShapeError, match="not the same cache rows"):
        latent_attention(q_latent, q_rope, kv, kr[:, :5], pos, 1.0)
    with pytest.raises(ShapeError, match="block_table has shape"):
        latent_attention(q_latent, q_rope, kv, kr, pos, 1.0, torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(DTypeError, match="block_table has dtype"):
        latent_attention(q_latent, q_rope, kv, kr, pos, 1.0, torch.zeros(2, 2))
    with pytest.raises(DTypeError, match="input_pos has dtype"):
        latent_attention(q_latent, q_rope, kv, kr, pos.float(), 1.0)
    with pytest.raises(DTypeError, match="one floating-point dtype"):
        latent_attention(q_latent.bfloat16(), q_rope, kv, kr, pos, 1.0)
