"""TritonKernel: a region's generated kernel at its chosen config, ready to launch.

On a GPU it launches the compiled binary (no JIT, so a loaded artifact never
recompiles) through launcher.py; on the `interpret` target it runs the same source
through Triton's interpreter on CPU tensors, where an index check of the generated code
that fails (an index tensor's position outside its dim) is an IndexOutOfRangeError.
A launch is first bound to a set of sizes (`bind`: size arguments, grid, scratch, the
arena's tensors), so a Program's call at sizes it has seen only looks up the tensors
that change per call and launches.

Scratch buffers the spec asks for are allocated here, on the device the kernel is
bound for, and shared by every kernel of the process on that device: kiln runs a
device's kernels one after another on one stream, and a kernel leaves its zeroed
buffers zero again, so one set serves all (a model's 32 layers do not each hold
their own). A launch that needs more allocates a larger buffer and keeps the old one
alive: a CUDA graph captured earlier still points at it.

A tensor argument with a block (spec.KernelArg) is passed as a TMA descriptor of the
tensor, made once at binding for the arena's tensors and weights, per launch for the
others (Triton's launcher encodes it on the host at each launch, ~1-2 us: templates
use them only for kernels that long).
"""

from __future__ import annotations

import torch

from kiln.codegen.build.compiler import Binary
from kiln.codegen.build.interpreter import INDEX_CHECK, failed_index_check
from kiln.codegen.build.launcher import Launch, current_stream, launch_for
from kiln.codegen.build.source import load_kernel
from kiln.codegen.build.spec import Config, KernelSpec, Scratch
from kiln.errors import IndexOutOfRangeError
from kiln.ir.plan import Region
from kiln.ir.symbolic import evaluate

_SCRATCH: dict[tuple, list[torch.Tensor]] = {}


def tensor_descriptor(t: torch.Tensor, block: list[int]):
    """`t`'s [-1, last dim] view as a TMA descriptor read in `block`s (Triton >= 3.4)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t.view(-1, t.shape[-1]), block)


def scratch_buffer(b: Scratch, position: int, numel: int, device) -> torch.Tensor:
    """The shared buffer for a kernel's `position`-th scratch, at least `numel` long."""
    kept = _SCRATCH.setdefault((str(device), b.dtype, b.zeroed, position), [])
    if not kept or kept[-1].numel() < numel:
        make = torch.zeros if b.zeroed else torch.empty
        kept.append(make(numel, dtype=b.dtype, device=device))
    return kept[-1]


class BoundLaunch:
    """One kernel's launch bound to a set of sizes: call it with every value by name and
    the stream. Only the tensors not fixed at binding (`holes`) are looked up per call."""

    __slots__ = ("launch", "plain", "dependent", "grid", "template", "holes", "zeros", "kept")

    def __init__(self, launch: Launch | None, grid: tuple[int, int, int], template: list,
                 holes: list[tuple[int, str, bool, list | None]], zeros: list, kept: list,
                 plain: Launch | None = None):
        self.launch = launch  # None: an empty grid, nothing to launch
        # the ordinary launch; `launch` may start as a programmatic dependent of the
        # kernel before it, which only a Program knows to be a kiln kernel (dependent)
        self.plain = plain if plain is not None else launch
        self.dependent = False
        self.grid = grid
        self.template = template  # the arguments, None where a hole is
        # (position, value name, is an input: make it dense, a descriptor's block or None)
        self.holes = holes
        self.zeros = zeros  # outputs zeroed before each launch (tensors, or value names)
        self.kept = kept  # the fixed tensors, whose pointers the template may hold as ints

    def __call__(self, values: dict[str, torch.Tensor], stream: int) -> None:
        if self.launch is None:
            self._zero(values)
            return
        args = self.template
        launch = self.launch if self.dependent and not self.zeros else self.plain
        if self.holes:
            args = args.copy()
            for pos, name, check, block in self.holes:
                t = values[name]
                if check and (not t.is_contiguous() or t.data_ptr() % 16):
                    t = t.contiguous().clone()  # kernels assume dense, 16-byte-aligned inputs
                    launch = self.plain  # that copy, not a kiln kernel, comes just before
                args[pos] = t if block is None else tensor_descriptor(t, block)
        self._zero(values)
        gx, gy, gz = self.grid
        launch(gx, gy, gz, stream, args)

    def _zero(self, values) -> None:
        for z in self.zeros:  # the kernel adds partial results into these
            (values[z] if isinstance(z, str) else z).zero_()


class TritonKernel:
    kind = "triton"

    def __init__(self, region: Region, spec: KernelSpec, config: Config,
                 binary: Binary | None = None, interpret: bool = False):
        self.region = region
        self.spec = spec
        self.config = config
        self.binary = binary
        self.interpret = interpret
        self._tunables = [config[t] for t in spec.tunables]
        self._params = config.as_dict()
        self._fn = load_kernel(spec.source, spec.name, interpret=True) if interpret else None
        if not interpret and binary is None:
            raise ValueError(f"kernel {spec.name} needs a compiled binary to run on a GPU")
        self._gpu = None  # the GPU launch, made on first use (it loads the module)
        self._gpu_plain = None  # the same, never as a programmatic dependent
        self._last = (None, None)  # run()'s binding: (sizes and device, bound launch)

    def sizes(self, env: dict[str, int]) -> dict[str, int]:
        """The kernel's size arguments by parameter name, at the sizes `env`."""
        return {a.name: evaluate(a.expr, env) for a in self.spec.args if a.kind == "size"}

    def launch_args(self, inputs: dict[str, torch.Tensor], outs: dict[str, torch.Tensor],
                    env: dict[str, int]) -> tuple[list, dict[str, int]]:
        """Every argument of a launch as tensors and numbers (inputs made dense, sizes,
        constexprs, scratch, tunables) and the size arguments by name: for benchmarks
        that time a launch of their own."""
        values, sizes = {**inputs, **outs}, self.sizes(env)
        args = []
        for a in self.spec.args:
            if a.kind == "tensor":
                t = values[a.value]
                if a.value not in outs and (not t.is_contiguous() or t.data_ptr() % 16):
                    t = t.contiguous().clone()
                if a.block is not None and t is not None:
                    t = tensor_descriptor(t, a.block_shape(self._params))
                args.append(t)
            else:
                args.append(sizes[a.name] if a.kind == "size" else a.expr)
        if self.spec.scratch:
            device = next(x.device for x in args if isinstance(x, torch.Tensor))
            _, numels = self.spec.launch_sizes(sizes, self.config.as_dict())
            args += [scratch_buffer(b, i, n, device)
                     for i, (b, n) in enumerate(zip(self.spec.scratch, numels))]
        return args + [self.config[t] for t in self.spec.tunables], sizes

    def bind(self, env: dict[str, int], fixed: dict[str, torch.Tensor],
             device: torch.device, outputs: frozenset[str] | None = None) -> BoundLaunch:
        """This kernel's launch at the sizes `env`, everything that depends only on them
        worked out once: size arguments, grid, scratch buffers (on `device`), and the
        tensors of `fixed` (values that are the same tensor on every call at these
        sizes: the arena's views). The result takes every value by name and the
        stream; the other tensors are looked up, and inputs among them made dense and
        16-byte aligned, at each launch (the region's `outputs` are written, not read)."""
        if outputs is None:
            outputs = frozenset(self.region.outputs if self.region is not None else ())
        sizes = self.sizes(env)
        grid, numels = self.spec.launch_sizes(sizes, self._params)
        plain = None
        if 0 in grid:
            launch = None
        elif self.interpret:
            launch = self._interpreted
        else:
            launch, plain = self._gpu_launch(), self._gpu_plain_launch()
        # On a GPU kiln's own memory (the arena's views, scratch) is passed as device
        # pointers: Triton's launcher then skips reading and checking each one.
        pointers = launch is not None and not self.interpret
        template, holes, kept = [], [], []
        for pos, a in enumerate(self.spec.args):
            if a.kind == "tensor":
                t = fixed.get(a.value)
                if t is not None and (not t.is_contiguous() or t.data_ptr() % 16):
                    t = None  # kernels assume dense, 16-byte-aligned tensors
                block = a.block_shape(self._params) if a.block is not None else None
                if t is None:
                    template.append(None)
                    holes.append((pos, a.value, a.value not in outputs, block))
                else:
                    if block is not None:
                        template.append(tensor_descriptor(t, block))
                    else:
                        template.append(t.data_ptr() if pointers else t)
                    kept.append(t)
            elif a.kind == "size":
                template.append(sizes[a.name])
            else:
                template.append(a.expr)
        for i, (b, n) in enumerate(zip(self.spec.scratch, numels)):
            t = scratch_buffer(b, i, n, device)
            template.append(t.data_ptr() if pointers else t)
        template += self._tunables
        zeros = [fixed.get(v, v) for v in self.spec.zero_outputs]
        return BoundLaunch(launch, grid, template, holes, zeros, kept, plain)

    def _interpreted(self, gx, gy, gz, stream, args) -> None:
        from triton.runtime.interpreter import InterpreterError

        try:
            self._fn[gx, gy, gz](*args, num_warps=self.config.num_warps,
                                 num_stages=self.config.num_stages)
        except BaseException as e:
            self._rezero_scratch(args)
            check = failed_index_check(e) if isinstance(e, InterpreterError) else None
            if check is None:
                raise
            raise self._index_error(check) from e

    def _rezero_scratch(self, args) -> None:
        """A launch that stopped part-way (a failed index check) left its zeroed scratch,
        which every kernel of the process shares, part-written: the next launch's
        ticket counters and flags would start there, and its programs wait forever."""
        first = len(self.spec.args)
        for i, b in enumerate(self.spec.scratch):
            if b.zeroed:
                args[first + i].zero_()

    def _index_error(self, check: str) -> IndexOutOfRangeError:
        """A generated index check failed (interpret target): the op whose index tensor
        held a position outside its dim, at the model's line where known."""
        op = check[len(INDEX_CHECK):].strip(" ()")
        region = self.region.name if self.region is not None else "?"
        lines = [o.where for o in (self.region.ops if self.region is not None else ())
                 if o.target == op and o.where]
        return IndexOutOfRangeError(
            f"kernel {self.spec.name} (region {region}): an index of {op} was out of range "
            "(an index tensor held a position outside the dim it indexes); nothing was read "
            "or written through it",
            where="; ".join(dict.fromkeys(lines)) or f"region {region}",
            hint="every index must lie inside the dim it indexes ([0, size); [-size, size) "
            "for x[idx] and x[idx] = v), as eager PyTorch also requires: check decode "
            "positions against the KV cache's length (a static cache of 16 slots takes "
            "positions 0..15: compile with a longer cache, or stop decoding there) and "
            "token ids against the vocabulary size. State the module updates in place may "
            "be partly written by this call")

    def _gpu_launch(self):
        if self._gpu is None:
            self._gpu = launch_for(self.binary.kernel(self.spec, self.config))
        return self._gpu

    def _gpu_plain_launch(self):
        if self._gpu_plain is None:
            if getattr(self.binary, "metadata", {}).get("launch_pdl"):
                self._gpu_plain = launch_for(self.binary.kernel(self.spec, self.config),
                                             dependent=False)
            else:  # an ordinary kernel: one launch serves both
                self._gpu_plain = self._gpu_launch()
        return self._gpu_plain

    def run(self, inputs: dict[str, torch.Tensor], outs: dict[str, torch.Tensor],
            env: dict[str, int]) -> None:
        values = {**inputs, **outs}
        device = next((values[a.value].device for a in self.spec.args if a.kind == "tensor"),
                      torch.device("cpu"))
        key = (tuple(sorted(env.items())), device, frozenset(outs))
        if self._last[0] != key:  # the tuner times one size many times
            self._last = (key, self.bind(env, {}, device, key[2]))
        self._last[1](values, current_stream(device))

    def describe(self) -> str:
        res = self.binary.resources if self.binary else None
        head = f"triton {self.spec.template} kernel {self.spec.name} [{self.config}]"
        if res is not None:
            head += (f" shared={res.shared}B regs={res.registers} spills={res.spills}")
        return head + "\n" + self.spec.source

    def to_json(self) -> dict:
        return {"kind": self.kind, "spec": self.spec.to_json(), "config": self.config.to_json()}
