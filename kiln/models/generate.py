"""Text generation with a kiln-compiled Llama: a prefill, then batched decode steps.

`LLM` compiles the model twice with kiln; both modules share its weights and KV cache:

    prefill(tokens [B, T], input_pos [B, T] (, block_table [B, W]))  B <= max_batch, T dynamic
    decode (tokens [B, 1], input_pos [B, 1] (, block_table [B, W]))  B <= max_batch

A lone sequence's decode step runs the decode module's narrow version, which
kiln.compile makes wherever the batch bound would take 16-bit products past their
GEMV form (kiln/dispatch/narrow_rows.py): one row keeps its GEMVs, folded norms and
grouped q/k/v. Prefill's T starts at 2: one token is a decode step.

(block_table only with the paged cache; W, its width, is dynamic too.) A batch of
prompts of different lengths is prefilled right-padded: a pad sits after its row's
last real token, so no real token attends to it, and decode overwrites it later
(with the paged cache pads past the row's blocks land in block 0). A model with
recurrent state (Qwen3-Next: `needs_seq_lens`) also gets each row's real length,
seq_lens [B], in prefill, so that padding does not advance its state. Each row then
decodes at its own position. With the contiguous cache a row keeps its cache row, so
finished rows ride along (their output is ignored); the paged cache drops them.
Choosing tokens (decoding.py) happens outside the compiled model.

On a GPU, decode steps replay captured CUDA graphs, one per batch-size bucket (1, 2,
4, ... max_batch): a batch is padded up to its bucket with rows that write position 0
of an unused cache row (contiguous) or the reserved block 0 (paged), and the paged
block table always has its full width, so every step of a bucket is the same graph.
Prefill, whose length varies, runs without graphs.

LLM.save writes both modules (their weights once) with the config and tokenizer, and
LLM.load reads them back without compiling (saved_llm.py): a loaded LLM has no
nn.Module (`model` is None), only the compiled modules and the cache's layout.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field

import torch
from torch.export import Dim

import kiln
from kiln.errors import ArgumentError, CheckpointError, ShapeError
from kiln.models import decode_ahead
from kiln.models.decoding import TextStream, sample
from kiln.models.kv_cache import BlockAllocator, PagedLayout
from kiln.models.llama import Llama
from kiln.models.saved_llm import read_saved_llm, save_llm
from kiln.progress import phase
from kiln.target import get_target


@dataclass
class Generation:
    """One sequence's result: generated ids (a stop token included) and text."""

    prompt_ids: list[int]
    ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (a stop token or string), "length" or "context"
    time_to_first_token_s: float
    decode_s: float  # from the first token to the last

    @property
    def tokens_per_s(self) -> float:
        return (len(self.ids) - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def summary(self) -> str:
        return (f"prompt {len(self.prompt_ids)} tokens, generated {len(self.ids)} "
                f"({self.finish_reason}); time to first token "
                f"{self.time_to_first_token_s * 1e3:.1f} ms; decode "
                f"{self.tokens_per_s:.1f} tokens/s")


@dataclass
class _Seq:
    row: int
    prompt: list[int]
    text: TextStream | None
    ids: list[int] = field(default_factory=list)
    finish: str | None = None
    t_first: float = 0.0
    t_last: float = 0.0

    @property
    def pos(self) -> int:
        """Where the last token is fed to produce the next."""
        return len(self.prompt) + len(self.ids) - 1


class LLM:
    """A model compiled for generation. Build it with kiln.models.load; `save` it to load
    it back later without compiling (kiln.models.saved_llm)."""

    def __init__(self, model: Llama, tokenizer=None, stop_ids=(), *, target="cpu",
                 max_batch_size: int = 1, paged: bool = False, block_size: int = 16,
                 num_blocks: int | None = None, name: str = "",
                 cuda_graphs: bool | None = None, compile_options: dict | None = None,
                 parallel: dict | None = None, read_weights=None, checkpoint=None):
        self.model = model
        self.compile_options = compile_options  # kiln.compile's options (e.g. tune)
        # {"tp": T, "pp": P}: this process is one rank (under torchrun) of a multi-device
        # plan; read_weights(wanted) then reads its parts of a model built on meta
        self.parallel = parallel
        self._setup(model.cfg, tokenizer, stop_ids, target, max_batch_size, paged,
                    getattr(model, "needs_seq_lens", False), name, checkpoint)
        if cuda_graphs and not self.target.is_gpu:  # said before minutes of compiling
            raise ArgumentError("CUDA graphs need a GPU target", hint="target='cuda'")
        check_cache_sizes(max_batch_size, block_size, num_blocks)
        self.dtype = model.lm_head.weight.dtype
        model.setup_cache(max_batch_size=max_batch_size, paged=paged,
                          block_size=block_size, num_blocks=num_blocks)
        if paged:
            c = model.cache
            self.cache_layout = PagedLayout(c.block_size, c.blocks_per_seq, c.num_blocks)
        t0 = time.perf_counter()
        with kiln.compile_session():  # one tuning run worker for both
            self.prefill_module = self._compile(seq_len=None)
            self.decode_module = self._compile(seq_len=1)
        if read_weights is not None:
            self._materialize(read_weights)
        self.compile_s = time.perf_counter() - t0
        staged = bool(parallel) and parallel.get("pp", 1) > 1  # no CUDA graphs of stages yet
        self._start(cuda_graphs, staged, t0)

    @classmethod
    def load(cls, path, target=None, cuda_graphs: bool | None = None, **asked) -> LLM:
        """The LLM saved at `path` by LLM.save, without compiling; `asked` holds
        kiln.models.load's other arguments, checked against what was compiled."""
        t0 = time.perf_counter()
        with phase("read"):
            saved = read_saved_llm(path, target, asked)
        self = cls.__new__(cls)
        self.model, self.compile_options, self.parallel = None, None, None
        self._setup(saved.cfg, saved.tokenizer, saved.stop_ids, saved.target,
                    saved.max_batch_size, saved.cache_layout is not None,
                    saved.needs_seq_lens, saved.name, path)
        self.dtype, self.cache_layout = saved.dtype, saved.cache_layout
        self.prefill_module, self.decode_module = saved.prefill, saved.decode
        self.compile_s = 0.0
        self._start(saved.cuda_graphs if cuda_graphs is None else cuda_graphs, False, t0)
        return self

    def save(self, path) -> None:
        """Write the compiled modules (weights once, KV caches as shapes only), the
        config, the tokenizer and the stop ids to the directory `path`, for
        kiln.models.load(path) / `kiln generate path`."""
        save_llm(self, path)

    def _setup(self, cfg, tokenizer, stop_ids, target, max_batch_size: int, paged: bool,
               needs_seq_lens: bool, name: str, checkpoint) -> None:
        """What every LLM holds, compiled now or loaded."""
        self.cfg, self.name = cfg, name
        # the checkpoint directory it came from: save copies its tokenizer and config
        self.checkpoint = checkpoint
        self.tokenizer, self.stop_ids = tokenizer, set(stop_ids)
        self.target = get_target(target)
        # compiling for a GPU on a machine without one (compile-only): the model, the
        # examples and the weights stay on the CPU; the LLM can be saved, not run
        self.runnable = not self.target.is_gpu or torch.cuda.is_available()
        self.device = torch.device(self.target.torch_device if self.runnable else "cpu")
        self.max_batch_size, self.paged = max_batch_size, paged
        self.needs_seq_lens = needs_seq_lens
        self.cache_layout = None  # a PagedLayout with the paged cache

    def _start(self, cuda_graphs: bool | None, staged: bool, t0: float) -> None:
        """Ready the compiled modules for requests: capture the decode graphs, warm prefill."""
        self.buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < self.max_batch_size]
        self.buckets.append(self.max_batch_size)
        self.cuda_graphs = (self.target.is_gpu and not staged) if cuda_graphs is None \
            else cuda_graphs
        if self.cuda_graphs and not self.target.is_gpu:
            raise ArgumentError("CUDA graphs need a GPU target", hint="target='cuda'")
        if self.runnable:
            if self.cuda_graphs:
                with phase("cuda_graphs"):
                    self.decode_module.cuda_graphs(max_graphs=len(self.buckets))
                    self._capture_buckets()
            with phase("warm_prefill"):
                self._warm_prefill()
        self.load_s = time.perf_counter() - t0

    def _materialize(self, read_weights) -> None:
        """Give both modules real tensors for the weights left on the meta device: this
        rank's slices (or whole replicated weights) read once, shared by both. Buffers
        the checkpoint gives (DeepSeek-V3's router correction, its W_UK / W_UV) are read
        so too; the others are computed (RoPE tables) or start as zeros (KV caches)."""
        modules = self.modules()
        self.model.init_rope(self.device)  # tables computed, not read
        params = dict(self.model.named_parameters(remove_duplicate=False))  # tied too
        own_buffers = dict(self.model.named_buffers())
        wanted, buffers = {}, {}
        for m in modules:
            for name, t in m.state.items():
                if t.device.type != "meta":
                    continue
                if name not in params and name not in own_buffers:
                    raise ArgumentError(
                        f"the compiled plan reads {name}, computed from weights that were "
                        "not loaded yet", hint="load the checkpoint whole (no tensor "
                        "parallelism) for this model, and report it")
                wanted[name] = m.weight_slices.get(name)
                if name not in params:
                    buffers[name] = t
        real = read_weights(wanted)
        unread = sorted(n for n in wanted if n not in real and n not in buffers)
        if unread:
            raise ArgumentError(f"the checkpoint reader gave no {', '.join(unread[:3])}",
                                hint="this is a kiln bug: report it")
        for m in modules:  # a padded vocabulary (vocab_padding.py): zero rows past the real
            for name, t in m.state.items():
                got = real.get(name)
                if got is not None and t.dim() and got.shape[0] < t.shape[0]:
                    real[name] = torch.cat([got, got.new_zeros(t.shape[0] - got.shape[0],
                                                                *got.shape[1:])])
        own_buffers = dict(self.model.named_buffers())
        for name, t in buffers.items():
            if name in real:
                continue
            mine = own_buffers[name]
            real[name] = (mine if mine.device.type != "meta"  # the RoPE tables
                          else torch.zeros(t.shape, dtype=t.dtype, device=self.device))
        for m in modules:
            m.state.update({n: real[n] for n in m.state if n in real})

    @property
    def max_seq_len(self) -> int:
        return self.cfg.max_seq_len

    def modules(self) -> tuple:
        """The compiled modules: prefill and decode."""
        return (self.prefill_module, self.decode_module)

    def _compile(self, seq_len: int | None):
        """Compile for T = seq_len (decode), or for a dynamic T in [2, max_seq_len] with
        logits at L dynamic positions per row (prefill: L = 1, the last prompt token)."""
        # a model still on the meta device (its weights are read after compiling) is
        # exported with meta examples: one device for every tensor export sees
        meta = self.model.lm_head.weight.device.type == "meta"
        dev = torch.device("meta") if meta else self.device
        args, shapes = generation_inputs(self.model, self.max_batch_size, seq_len, dev,
                                         self.paged)
        return kiln.compile(self.model, (), kwargs=args, dynamic_shapes=shapes,
                            target=self.target, options=self.compile_options,
                            parallel=self.parallel)

    def _capture_buckets(self) -> None:
        """Capture every bucket's decode graph now, so no request pays for a capture.

        The dummy step writes position 0 of cache rows (or block 0) that a prefill
        rewrites before any real token reads them.
        """
        for b in self.buckets:
            table = None
            if self.paged:
                table = torch.zeros(b, self.cache_layout.blocks_per_seq, dtype=torch.long,
                                    device=self.device)
            zeros = torch.zeros(b, 1, dtype=torch.long, device=self.device)
            self.forward(zeros, zeros, table)

    def _warm_prefill(self) -> None:
        """Run the prefill module once, so the first request does not pay for loading its
        kernels onto the GPU (a third of a second for an 8B model) or for warming PyTorch's
        CPU ops (20 ms for the tiny Llama).

        The two dummy tokens land at positions 0 and 1 of cache row 0 (or block 0), which
        a real prefill rewrites before any token reads them.
        """
        t = min(2, self.max_seq_len)
        table = None
        if self.paged:
            table = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.forward(torch.zeros(1, t, dtype=torch.long, device=self.device),
                     torch.arange(t, device=self.device), table)
        if self.target.is_gpu:
            torch.cuda.synchronize(self.device)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor,
                block_table: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None,
                seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] from the compiled prefill (T > 1) or decode (T = 1) module;
        for T > 1, only at `logits_at` ([B, L] indices into T) when given, and with
        seq_lens [B] real tokens per row (the rest right padding; default all T).

        input_pos may be [T] (shared by the rows); inputs move to the model's device.
        """
        if self.paged != (block_table is not None):
            raise ArgumentError("a block_table is needed with the paged cache, and only then")
        B, T = _check_tokens(tokens, input_pos)
        args = {"tokens": tokens, "input_pos": input_pos.expand(B, T)}
        if self.paged:
            args["block_table"] = block_table
        module = self.decode_module
        if T > 1:
            module = self.prefill_module
            if logits_at is None:
                logits_at = torch.arange(T).expand(B, T)
            args["logits_at"] = logits_at
            if self.needs_seq_lens:
                args["seq_lens"] = (seq_lens if seq_lens is not None
                                    else torch.full((B,), T, dtype=torch.long))
        elif logits_at is not None:
            raise ArgumentError("logits_at is for prefill (more than one token)",
                                hint="a decode step has logits at its one token only")
        args = {k: a.to(self.device).contiguous() for k, a in args.items()}
        return module(**args)

    # ---- generate --------------------------------------------------------------------

    def generate(self, prompt, max_new_tokens: int = 128, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, stop=(), ignore_eos: bool = False,
                 on_text=None):
        """Generate from a prompt (text or token ids) or a list of prompts (a batch).

        Greedy by default; temperature > 0 samples (with top_k / top_p, reproducible
        with seed). Stops at an eos token of the checkpoint (unless ignore_eos), at a
        `stop` entry (a string or a token id), after max_new_tokens, or when the
        context is full. on_text(str) receives text as it is produced (one prompt only).
        Returns a Generation, or a list of them for a list of prompts.
        """
        single, prompts = _prompts(prompt)
        if on_text is not None and not callable(on_text):
            raise ArgumentError(f"on_text must be a function of the new text, got "
                                f"{type(on_text).__name__}")
        if on_text is not None and len(prompts) != 1:
            raise ArgumentError("on_text streams one prompt; got a batch of "
                                f"{len(prompts)}")
        check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
        stop = _stops(stop)
        stop_ids = set() if ignore_eos else set(self.stop_ids)
        stop_ids |= {s for s in stop if isinstance(s, int)}
        stops = [s for s in stop if isinstance(s, str)]
        seqs = []
        for i, p in enumerate(prompts):
            ids = self._encode(p)
            seqs.append(_Seq(i, ids, self._text(stops, ids)))
        self._check_fits(seqs)
        gen = None
        if seed is not None:  # where the logits are: sampling never waits for the host
            gen = torch.Generator(device=self.device if self.runnable else "cpu")
            gen.manual_seed(seed)

        def pick(logits):
            return sample(logits, temperature, top_k, top_p, gen)

        def add(seq: _Seq, token: int, now: float):
            seq.ids.append(token)
            seq.t_last = now
            if seq.text is not None:
                new = seq.text.update(seq.ids if token not in stop_ids else seq.ids[:-1])
                if new and on_text is not None:
                    on_text(new)
            if token in stop_ids or (seq.text is not None and seq.text.stopped):
                seq.finish = "stop"
            elif len(seq.ids) >= limit[0]:
                seq.finish = "length"
            elif seq.pos >= self.max_seq_len:
                seq.finish = "context"

        alloc = BlockAllocator(self.cache_layout) if self.paged else None
        refill = self._refill_at(seqs)
        limit = [max_new_tokens if refill is None else
                 min(max_new_tokens, refill + 1 - len(seqs[0].prompt))]
        try:
            t0 = time.perf_counter()
            first = pick(self._prefill(seqs, alloc)).tolist()
            now = time.perf_counter()
            for s, tok in zip(seqs, first):
                s.t_first = now
                add(s, tok, now)
            decode_ahead.decode(self, seqs, alloc, pick, add, limit[0])
            s = seqs[0]
            if limit[0] < max_new_tokens and s.finish == "length":
                # at the longrope switch: the whole sequence again, as transformers does
                s.finish, limit[0] = None, max_new_tokens
                again = _Seq(s.row, s.prompt + s.ids, None)
                add(s, pick(self._prefill([again], alloc)).tolist()[0], time.perf_counter())
                decode_ahead.decode(self, seqs, alloc, pick, add, max_new_tokens)
        finally:
            for s in seqs:
                if alloc is not None:
                    alloc.release(s.row)
        rest = seqs[0].text.flush() if seqs[0].text is not None else ""
        if rest and on_text is not None:  # text held back for a stop string that never came
            on_text(rest)
        results = [self._result(s, t0) for s in seqs]
        return results[0] if single else results

    def _refill_at(self, seqs: list[_Seq]) -> int | None:
        """The position where one sequence is prefilled again (RecipeConfig.refill_at: a
        longrope model's switch), when its prompt ends at or before it and the cache
        reaches past it; None otherwise."""
        at = getattr(self.cfg, "refill_at", None)
        if at is None or len(seqs) != 1 or self.paged:
            return None
        return at if len(seqs[0].prompt) <= at < self.max_seq_len - 1 else None

    def _prefill(self, seqs: list[_Seq], alloc: BlockAllocator | None) -> torch.Tensor:
        """Prefill every prompt in one right-padded batch; logits at each last token."""
        lens = [len(s.prompt) for s in seqs]
        T = max(lens)
        tokens = torch.zeros(len(seqs), T, dtype=torch.long)
        for s in seqs:
            tokens[s.row, :len(s.prompt)] = torch.tensor(s.prompt)
        table = None
        if alloc is not None:
            for s in seqs:
                alloc.reserve(s.row, len(s.prompt))
            width = math.ceil(T / alloc.block_size)
            table = alloc.block_table([s.row for s in seqs], width, self.device)
        last = (torch.tensor(lens) - 1)[:, None] if T > 1 else None  # T = 1: decode module
        seq_lens = torch.tensor(lens) if T > 1 else None
        return self.forward(tokens, torch.arange(T), table, logits_at=last,
                            seq_lens=seq_lens)[:, 0]

    def _decode_step(self, batch: list[_Seq], alloc: BlockAllocator | None,
                     tokens: torch.Tensor, pos: list[int]) -> torch.Tensor:
        """One decode step of `batch`: device tokens [n] fed at positions `pos` (a row
        that already finished repeats a step); logits [n, vocab]. Nothing here waits
        for the device (kiln.models.decode_ahead)."""
        n = len(batch)
        rows = n if not self.cuda_graphs else next(b for b in self.buckets if b >= n)
        pos = pos + [0] * (rows - n)  # pad rows: token 0 at position 0 of a spare row
        tokens = tokens.view(n, 1)
        if rows > n:
            tokens = torch.cat([tokens, tokens.new_zeros(rows - n, 1)])
        table = None
        if alloc is not None:
            for s, p in zip(batch, pos):
                alloc.reserve(s.row, p + 1)
            width = self.cache_layout.blocks_per_seq if self.cuda_graphs else None
            table = alloc.block_table([s.row for s in batch], width)
            if rows > n:  # pad rows own only block 0, which is never handed out
                table = torch.cat([table, table.new_zeros(rows - n, table.shape[1])])
            table = decode_ahead.to_device(table, self.device)
        at = decode_ahead.to_device(torch.tensor(pos).view(rows, 1), self.device)
        return self.forward(tokens, at, table)[:n, -1]

    # ---- helpers ---------------------------------------------------------------------

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise CheckpointError(
                    f"{self.name or 'this model'} has no tokenizer.json: a text prompt "
                    "cannot be encoded", hint="pass the prompt as token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
            if not all(_is_int(i) for i in ids):
                bad = next(i for i in ids if not _is_int(i))
                raise ArgumentError(f"a prompt of token ids holds {bad!r}, not an int",
                                    hint="give text, or a list of int token ids")
            ids = [int(i) for i in ids]
        if not ids:
            raise ArgumentError("the prompt is empty (no tokens)")
        bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
        if bad:
            raise ArgumentError(f"prompt token id {bad[0]} is outside the vocabulary "
                                f"[0, {self.cfg.vocab_size})")
        return ids

    def _text(self, stops: list[str], prompt: list[int]) -> TextStream | None:
        return TextStream(self.tokenizer, stops, prompt) if self.tokenizer is not None else None

    def _check_fits(self, seqs: list[_Seq]) -> None:
        if len(seqs) > self.max_batch_size:
            raise ShapeError(f"{len(seqs)} prompts exceed the maximum batch of "
                             f"{self.max_batch_size}",
                             hint="load the model with a larger max_batch_size")
        for s in seqs:
            if len(s.prompt) > self.max_seq_len:
                raise ShapeError(
                    f"prompt {s.row} has {len(s.prompt)} tokens, more than the maximum "
                    f"context of {self.max_seq_len} tokens (max_seq_len)",
                    hint="shorten the prompt, or load with a larger max_seq_len (up to "
                    "the model's max_position_embeddings)")

    def _result(self, s: _Seq, t0: float) -> Generation:
        text = s.text.text if s.text is not None else None
        return Generation(s.prompt, s.ids, text, s.finish or "length", s.t_first - t0,
                          s.t_last - s.t_first)


def generation_inputs(model, max_batch_size: int, seq_len: int | None, device,
                      paged: bool = False) -> tuple[dict, dict]:
    """The example kwargs and dynamic shapes an LLM exports `model` with (its KV cache
    set up; `paged`: a block table too): decode at T = seq_len, or prefill over a
    dynamic T in [2, max_seq_len] (one token is a decode step; a Dim from 1 would have
    kiln.compile make prefill a narrow version for it) with logits at L dynamic
    positions per row (L = 1, the last prompt token). Apart from LLM so the exports can
    be had uncompiled."""
    max_seq_len = model.cfg.max_seq_len
    b = min(2, max_batch_size)  # an example of 1 would pin the batch dim to 1
    t = seq_len or min(8, max_seq_len)
    batch = Dim("batch", min=1, max=max_batch_size) if b > 1 else None
    seq = Dim("seq", min=2, max=max_seq_len) if seq_len is None and t > 2 else None
    dims = {k: d for k, d in ((0, batch), (1, seq)) if d is not None}
    args = {"tokens": torch.zeros(b, t, dtype=torch.long, device=device),
            "input_pos": torch.arange(t, device=device).expand(b, t).contiguous()}
    shapes = {"tokens": dims, "input_pos": dims}
    if paged:
        cache = model.cache
        w = min(max(2, math.ceil(t / cache.block_size)), cache.blocks_per_seq)
        width = Dim("blocks", min=1, max=cache.blocks_per_seq) if w > 1 else None
        args["block_table"] = torch.zeros(b, w, dtype=torch.long, device=device)
        shapes["block_table"] = {k: d for k, d in ((0, batch), (1, width)) if d is not None}
    if seq is not None:
        rows = Dim("logit_rows", min=1, max=max_seq_len)
        args["logits_at"] = torch.zeros(b, 2, dtype=torch.long, device=device)
        shapes["logits_at"] = {k: d for k, d in ((0, batch), (1, rows)) if d is not None}
        if getattr(model, "needs_seq_lens", False):
            args["seq_lens"] = torch.full((b,), t, dtype=torch.long, device=device)
            shapes["seq_lens"] = {0: batch} if batch is not None else None
    return args, shapes


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _prompts(prompt) -> tuple[bool, list]:
    """(one prompt?, the prompts): text, a list (or 1-D tensor) of token ids, or a list
    (or 2-D tensor) of those."""
    if isinstance(prompt, str):
        return True, [prompt]
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() in (1, 2) and not prompt.is_floating_point():
            return prompt.dim() == 1, [prompt] if prompt.dim() == 1 else list(prompt)
        raise ArgumentError(f"a prompt tensor must hold int token ids in 1 or 2 dims, got "
                            f"{prompt.dtype} of shape {list(prompt.shape)}")
    if isinstance(prompt, (list, tuple)):
        if not prompt or _is_int(prompt[0]):
            return True, [prompt]
        if all(isinstance(p, (str, list, tuple, torch.Tensor)) for p in prompt):
            return False, list(prompt)
    raise ArgumentError(f"cannot read a prompt from {type(prompt).__name__} {prompt!r:.60}",
                        hint="give text, a list of int token ids, or a list of those "
                        "(a batch)")


def _stops(stop) -> list:
    """`stop` as a list of strings and token ids (one string or id alone is one stop)."""
    if isinstance(stop, (str, int)) and not isinstance(stop, bool):
        return [stop]
    if isinstance(stop, (list, tuple, set)) and all(
            isinstance(s, str) or _is_int(s) for s in stop):
        return list(stop)
    raise ArgumentError(f"stop must be a string, a token id or a list of those, got "
                        f"{stop!r:.60}")


def _check_tokens(tokens, input_pos) -> tuple[int, int]:
    """(B, T) of forward's tokens [B, T]; input_pos is [T] or [B, T]."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or \
            tokens.is_floating_point():
        raise ShapeError(f"tokens must be an int tensor [batch, length], got "
                         f"{_describe(tokens)}")
    B, T = tokens.shape
    if not isinstance(input_pos, torch.Tensor) or \
            list(input_pos.shape) not in ([T], [B, T], [1, T]):
        raise ShapeError(f"input_pos must be [{T}] or [{B}, {T}] like tokens, got "
                         f"{_describe(input_pos)}",
                         hint="the position of each token: e.g. torch.arange(T) in prefill")
    return B, T


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} of shape {list(x.shape)}"
    return type(x).__name__


def check_sampling(max_new_tokens, temperature, top_k, top_p, seed=None) -> None:
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ArgumentError(f"max_new_tokens must be at least 1, got {max_new_tokens!r}")
    if not _is_number(temperature) or temperature < 0:
        raise ArgumentError(f"temperature must be >= 0 (0 is greedy), got {temperature!r}")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise ArgumentError(f"top_k must be at least 1, got {top_k!r}")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise ArgumentError(f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None and not _is_int(seed):
        raise ArgumentError(f"seed must be an int, got {seed!r}")


def check_cache_sizes(max_batch_size, block_size, num_blocks) -> None:
    """The KV cache's sizes are positive ints (a 0 or a str failed deep inside torch)."""
    for name, v in (("max_batch_size", max_batch_size), ("block_size", block_size)):
        if not _is_int(v) or v < 1:
            raise ArgumentError(f"{name} must be a positive int, got {v!r}")
    if num_blocks is not None and (not _is_int(num_blocks) or num_blocks < 2):
        raise ArgumentError(f"num_blocks must be at least 2 (block 0 is reserved), got "
                            f"{num_blocks!r}", hint="or leave it None: enough for every row "
                            "at the full context")
