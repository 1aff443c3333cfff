"""A rank's part of a checkpoint: the slices its multi-device plan holds, read through
safetensors' lazy slices, never the whole model.

The plan (kiln.parallel's derived sharding) says, for every state tensor a rank holds,
which ranges of which axis are its own (CompiledModule.weight_slices: (axis, [(start,
end), ...]), None for a tensor held whole). `RankReader.read(wanted)` makes them:

- a tensor the checkpoint stores is read at exactly those ranges (`get_slice`);
- stacked experts (one checkpoint tensor per expert) are read expert by expert: a cut
  of axis 0 reads only the rank's experts, a cut of another axis cuts each expert;
- a tensor the model holds as fp8 (fp8.Fp8Linear, moe.Fp8Experts) is read as stored
  from an fp8 checkpoint, or quantised from its own slice (quantize="fp8"), with its
  block scales cut in the same 128 x 128 blocks. Slices that hold whole blocks quantise
  exactly as the whole weight does; a cut through a block is a ShapeError naming the
  weight and the cut;
- an fp8 weight the model holds in a real dtype is dequantised slice by slice, with the
  scale blocks that cover it;
- every tensor in the dtype of the (meta) model tensor it fills.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from kiln.errors import CheckpointError, KilnError, ShapeError
from kiln.ops import quantize_experts, quantize_weight

BLOCK = 128  # the fp8 weights' scale blocks (kiln.ops.fp8_linear)
SCALE_SUFFIX = "_scale_inv"
FP8 = torch.float8_e4m3fn

Cut = tuple[int, list[tuple[int, int]]] | None


class RankReader:
    """Reads a rank's parts of the model tensors `model` (built on the meta device, in
    the dtypes and fp8 layout the rank holds) from checkpoint tensors `found` (name ->
    (file, shape): headers only), filled as `mapping` says (checkpoint name -> (model
    tensor, expert slot or None)). `dtype` is the real dtype fp8 weights are quantised
    from."""

    def __init__(self, model: nn.Module, found: dict, mapping: dict, dtype: torch.dtype,
                 device):
        self.found, self.dtype, self.device = found, dtype, device
        self.meta = dict(model.named_parameters(remove_duplicate=False)) | \
            dict(model.named_buffers(remove_duplicate=False))
        self.sources: dict[str, list[tuple[int | None, str]]] = {}
        for name, (dest, slot) in mapping.items():
            self.sources.setdefault(dest, []).append((slot, name))
        for pieces in self.sources.values():
            pieces.sort(key=lambda p: p[0] or 0)
        named = {id(t): n for n, t in self.meta.items() if n in self.sources}
        for name, t in self.meta.items():  # tied weights: one checkpoint tensor, two names
            if name not in self.sources and id(t) in named:
                self.sources[name] = self.sources[named[id(t)]]
        self._stack: contextlib.ExitStack | None = None  # open while reading
        self._files: dict[Path, object] = {}
        self._quantised: dict = {}

    def holds(self, name: str) -> bool:
        """Does the checkpoint give model tensor `name` (stored, or quantised from it)?"""
        return name in self.sources or self._fp8_weight_of(name) is not None

    def read(self, wanted: dict[str, Cut]) -> dict[str, torch.Tensor]:
        """{model tensor: this rank's part} for each name of `wanted` the checkpoint
        holds (others, such as caches and RoPE tables, are the caller's)."""
        out = {}
        with contextlib.ExitStack() as stack:
            self._stack = stack
            for name, cut in wanted.items():
                if self.holds(name):
                    out[name] = self.value(name, cut).to(self.device).contiguous()
            self._files.clear()
            self._quantised.clear()
        return out

    # -- what the model holds -----------------------------------------------------------

    def value(self, name: str, cut: Cut) -> torch.Tensor:
        """Model tensor `name`'s part `cut` as the model holds it."""
        target = self.meta[name]
        if target.dtype == FP8:
            return self.fp8(name, cut)[0]
        weight = self._fp8_weight_of(name)
        if weight is not None:  # an fp8 weight's block scales
            return self.fp8(weight, _weight_cut(cut, self.meta[weight].shape))[1]
        return self.real(name, cut).to(target.dtype)

    def real(self, name: str, cut: Cut) -> torch.Tensor:
        """The real values (dequantised if stored fp8) of model tensor `name` at `cut`;
        an fp8 model tensor's as its fp8 bytes and block scales stand for them."""
        if self.meta[name].dtype == FP8:
            return _dequantise(*self._fp8_parts(name, cut))
        return self._stacked(name, cut, self._real_piece)

    def fp8(self, name: str, cut: Cut) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp8 part, its block scales) of the fp8 model weight `name` at `cut`: as
        stored, or quantised from its real slice. The cut must hold whole blocks. Kept
        until both halves were taken: the weight and its scales are read once."""
        key = (name, None if cut is None else (cut[0], tuple(cut[1])))
        if key not in self._quantised:
            self._quantised[key] = [*self._fp8_parts(name, cut), 0]
        entry = self._quantised[key]
        entry[2] += 1
        if entry[2] == 2:
            del self._quantised[key]
        return entry[0], entry[1]

    def _fp8_parts(self, name: str, cut: Cut) -> tuple[torch.Tensor, torch.Tensor]:
        shape = tuple(self.meta[name].shape)
        _check_blocks(name, shape, cut)
        if self.sources[name][0][1] + SCALE_SUFFIX in self.found:  # stored fp8
            return (self._stacked(name, cut, self._raw),
                    self._stacked(name + SCALE_SUFFIX, _scale_cut(cut, shape), self._raw))
        w = self._stacked(name, cut, self._real_piece).to(self.device, self.dtype)
        return quantize_experts(w) if w.dim() == 3 else quantize_weight(w)

    def _fp8_weight_of(self, name: str) -> str | None:
        """The fp8 weight whose block scales model tensor `name` is, if it is one
        (Fp8Linear's weight -> weight_scale_inv, Fp8Experts' gate_proj ->
        gate_proj_scale_inv)."""
        weight = name.removesuffix(SCALE_SUFFIX)
        if weight != name and weight in self.meta and self.meta[weight].dtype == FP8:
            return weight
        return None

    # -- checkpoint tensors -------------------------------------------------------------

    def _stacked(self, name: str, cut: Cut, piece) -> torch.Tensor:
        """Model tensor `name` from its checkpoint pieces: one tensor, or one per expert
        slot stacked (axis 0 picks experts; another axis cuts each)."""
        pieces = self.sources[name]
        if pieces[0][0] is None:
            return piece(pieces[0][1], cut)
        if cut is not None and cut[0] == 0:  # these experts, whole
            return torch.stack([piece(pieces[e][1], None) for a, b in cut[1]
                                for e in range(a, b)])
        inner = None if cut is None else (cut[0] - 1, cut[1])
        return torch.stack([piece(n, inner) for _, n in pieces])

    def _raw(self, name: str, cut: Cut) -> torch.Tensor:
        """Checkpoint tensor `name` at `cut`, as stored."""
        f = self.found[name][0]
        with reading(f):
            if f not in self._files:
                self._files[f] = self._stack.enter_context(safe_open(str(f), framework="pt"))
            part = self._files[f].get_slice(name)
            if cut is None:
                return part[:]
            axis, ranges = cut
            lead = (slice(None),) * axis
            pieces = [part[(*lead, slice(a, b))] for a, b in ranges]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, axis)

    def _real_piece(self, name: str, cut: Cut) -> torch.Tensor:
        """Checkpoint tensor `name` at `cut`, dequantised if it is stored fp8: every
        element times the scale of its block, read for the blocks the cut covers (on
        the device: V3's thousands of expert tensors take ~0.1 s each on a CPU)."""
        t = self._raw(name, cut)
        if name + SCALE_SUFFIX not in self.found:
            return t
        shape = self.found[name][1]
        blocks = _scale_cut(cut, shape)
        t = t.to(self.device)
        s = self._raw(name + SCALE_SUFFIX, blocks).to(self.device).float()
        for axis in range(2):
            if cut is not None and cut[0] == axis:  # the cut's rows -> the blocks read
                index, base = [], 0
                for (a, b), (ba, bb) in zip(cut[1], blocks[1]):
                    index.append(torch.arange(a, b) // BLOCK - ba + base)
                    base += bb - ba
                index = torch.cat(index)
            else:
                index = torch.arange(shape[axis]) // BLOCK
            s = s.index_select(axis, index.to(s.device))
        return t.float() * s


def _dequantise(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 values of fp8 `q` [.., R, C] with block scales `s` [.., ceil(R/128), ..]."""
    R, C = q.shape[-2:]
    scale = s.float().repeat_interleave(BLOCK, -2)[..., :R, :].repeat_interleave(BLOCK, -1)
    return q.float() * scale[..., :C]


def _block_axes(shape) -> tuple[int, ...]:
    """The axes cut in 128-blocks: the last two (stacked experts' axis 0 is not)."""
    return (len(shape) - 2, len(shape) - 1)


def _scale_cut(cut: Cut, shape) -> Cut:
    """The cut of a weight's block scales that covers the weight's `cut`."""
    if cut is None or cut[0] not in _block_axes(shape):
        return cut
    return cut[0], [(a // BLOCK, -(-b // BLOCK)) for a, b in cut[1]]


def _weight_cut(cut: Cut, shape) -> Cut:
    """The weight's cut whose block scales are `cut` (whole blocks)."""
    if cut is None or cut[0] not in _block_axes(shape):
        return cut
    size = shape[cut[0]]
    return cut[0], [(a * BLOCK, min(b * BLOCK, size)) for a, b in cut[1]]


def _check_blocks(name: str, shape, cut: Cut) -> None:
    """A cut of an fp8 weight must hold whole 128 x 128 blocks: its scales cannot say
    anything about a part of a block."""
    if cut is None or cut[0] not in _block_axes(shape):
        return
    axis, ranges = cut
    size = shape[axis]
    bad = [(a, b) for a, b in ranges if a % BLOCK or (b % BLOCK and b != size)]
    if bad:
        a, b = bad[0]
        raise ShapeError(
            f"fp8 weight {name} {list(shape)} is scaled in {BLOCK}x{BLOCK} blocks; this "
            f"rank's slice of axis {axis} is {a}:{b} of {size}, which cuts through a block",
            where=name,
            hint=f"choose a tensor_parallel_size whose slices of axis {axis} are multiples "
            f"of {BLOCK}, or load the weights unquantised (no quantize='fp8'; "
            "keep_fp8=False for an fp8 checkpoint)")


@contextlib.contextmanager
def reading(f: Path):
    """Reading tensor data from shard `f`: a failure that is not already a KilnError
    becomes a CheckpointError naming the file (a truncated download, a bad header)."""
    try:
        yield
    except KilnError:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot read tensor data from {f.name}: {e}", where=str(f),
                              hint="the file may be truncated or corrupt: download it "
                              "again") from None
