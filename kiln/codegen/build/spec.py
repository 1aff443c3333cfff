"""A generated Triton kernel, independent of the config it will run with.

A `KernelSpec` is readable Triton source plus how to call it: which region values
its pointer arguments are, which size expressions its integer arguments are, the
grid as expressions over those sizes and the tunable constexprs, and the candidate
`Config`s. Generators (pointwise, reduction) and templates (matmul, attention) all
produce KernelSpecs; the autotuner, the resource model and the runtime consume them.

A kernel may also ask for `Scratch` buffers: memory its programs share within one
launch (a split reduction's partial results and arrival counters,
kiln.codegen.templates.split_k). They are no region values: the launcher allocates
them from size expressions (like the grid's) and passes them after the arguments,
before the tunables.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

import torch

from kiln.ir.symbolic import Dim, parse, to_str

TRITON_DTYPES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
    torch.float64: "fp64", torch.int64: "i64", torch.int32: "i32", torch.int16: "i16",
    torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
    torch.float8_e4m3fn: "fp8e4nv",  # block-scaled fp8 weights (templates/fp8_matmul)
}
_DTYPE_NAMES = {str(d).replace("torch.", ""): d for d in TRITON_DTYPES}


@dataclass(frozen=True)
class Config:
    """One point of a kernel's config space: tunable constexprs, warps, pipeline stages."""

    params: tuple[tuple[str, int], ...] = ()
    num_warps: int = 4
    num_stages: int = 1

    @staticmethod
    def make(num_warps: int = 4, num_stages: int = 1, **params) -> Config:
        return Config(tuple(sorted(params.items())), num_warps, num_stages)

    def __getitem__(self, name: str) -> int:
        return dict(self.params)[name]

    def as_dict(self) -> dict[str, int]:
        return dict(self.params)

    def __str__(self) -> str:
        ps = ",".join(f"{k}={v}" for k, v in self.params)
        return f"{ps}{',' if ps else ''}warps={self.num_warps},stages={self.num_stages}"

    def to_json(self) -> dict:
        return {"params": dict(self.params), "num_warps": self.num_warps,
                "num_stages": self.num_stages}

    @staticmethod
    def from_json(d: dict) -> Config:
        return Config.make(d["num_warps"], d["num_stages"], **d["params"])


@dataclass
class KernelArg:
    """One runtime argument of the kernel, in parameter order.

    A tensor with a `block` is passed as a TMA descriptor (Hopper's bulk tensor loads)
    of its [-1, last dim] view, loaded in blocks of that shape: ints, or the names of
    tunables (the block is then per config, and so is the kernel's signature)."""

    name: str
    kind: str  # "tensor" | "size" | "constexpr"
    value: str | None = None  # tensor: the region input/output value it points at
    expr: Dim | float | bool | None = None  # size: dim expression; constexpr: the value
    dtype: torch.dtype | None = None  # tensor: element type
    block: tuple[int | str, ...] | None = None  # tensor: a TMA descriptor's block

    def block_shape(self, params: dict[str, int]) -> list[int]:
        """The descriptor's block at a config's tunables `params`."""
        return [params[b] if isinstance(b, str) else b for b in self.block]

    def triton_type(self, index_bits: int = 32, params: dict[str, int] | None = None) -> str:
        if self.kind == "tensor":
            if self.block is not None:
                dims = ", ".join(map(str, self.block_shape(params or {})))
                return f"tensordesc<{TRITON_DTYPES[self.dtype]}[{dims}]>"
            return "*" + TRITON_DTYPES[self.dtype]
        if self.kind == "size":
            return "i64" if index_bits == 64 else "i32"
        return "constexpr"

    def to_json(self) -> dict:
        d = {"name": self.name, "kind": self.kind}
        if self.value is not None:
            d["value"] = self.value
        if self.dtype is not None:
            d["dtype"] = str(self.dtype).replace("torch.", "")
        if self.expr is not None:
            d["expr"] = to_str(self.expr) if self.kind == "size" else self.expr
        if self.block is not None:
            d["block"] = list(self.block)
        return d

    @staticmethod
    def from_json(d: dict, int_args: frozenset[str] = frozenset()) -> KernelArg:
        """`int_args`: the plan's int-argument symbols, read as `parse` says."""
        expr = d.get("expr")
        if d["kind"] == "size" and expr is not None:
            expr = parse(expr, int_args)
        dtype = _DTYPE_NAMES[d["dtype"]] if "dtype" in d else None
        block = tuple(d["block"]) if "block" in d else None
        return KernelArg(d["name"], d["kind"], d.get("value"), expr, dtype, block)


@dataclass(frozen=True)
class Scratch:
    """A buffer the launcher provides: `numel` is a Python expression over the size
    arguments and tunables (as the grid is). `zeroed` buffers read zero at every launch:
    they are zero-filled when allocated and the kernel must leave them zero again."""

    name: str  # the kernel parameter
    dtype: torch.dtype
    numel: str
    zeroed: bool = False

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": str(self.dtype).replace("torch.", ""),
                "numel": self.numel, "zeroed": self.zeroed}

    @staticmethod
    def from_json(d: dict) -> Scratch:
        return Scratch(d["name"], _DTYPE_NAMES[d["dtype"]], d["numel"], d["zeroed"])

    def numel_for(self, sizes: dict[str, int], config: Config) -> int:
        env = {**sizes, **config.as_dict()}
        return max(1, eval(_grid_code((self.numel,)), _SCOPE, env)[0])  # noqa: S307


@dataclass
class KernelSpec:
    name: str  # the @triton.jit function's name in `source`
    source: str  # a whole Python module: imports + the kernel
    args: list[KernelArg]  # parameters in order, before the tunables
    tunables: list[str]  # constexpr parameters set by a Config, after `args`
    grid: tuple[str, ...]  # Python expressions over size-arg names, tunables and cdiv
    configs: list[Config]  # the candidates the autotuner may try
    default: Config  # the heuristic choice (tune=none)
    template: str  # "pointwise", "reduction", "matmul", "attention": picks the resource model
    meta: dict = field(default_factory=dict)  # template parameters (tile shapes, dtypes, ...)
    index_bits: int = 32  # 64 when some size may exceed 2**31 - 1
    # output values every launch zeroes before the kernel runs (the kernel adds into them)
    zero_outputs: list[str] = field(default_factory=list)
    scratch: list[Scratch] = field(default_factory=list)  # parameters after `args`

    @property
    def source_hash(self) -> str:
        fixed = repr([(a.name, a.kind, a.expr if a.kind == "constexpr" else None,
                       str(a.dtype)) + ((a.block,) if a.block else ()) for a in self.args])
        if self.scratch:  # their dtypes are part of the signature
            fixed += repr([(b.name, str(b.dtype)) for b in self.scratch])
        return hashlib.sha256((self.source + fixed).encode()).hexdigest()[:24]

    def signature(self, config: Config | None = None) -> dict[str, str]:
        """Triton's signature; a kernel with TMA descriptors has one per `config`."""
        params = config.as_dict() if config is not None else {}
        sig = {a.name: a.triton_type(self.index_bits, params) for a in self.args}
        sig.update({b.name: "*" + TRITON_DTYPES[b.dtype] for b in self.scratch})
        sig.update({t: "constexpr" for t in self.tunables})
        return sig

    def constexprs(self, config: Config) -> dict[str, object]:
        out = {a.name: a.expr for a in self.args if a.kind == "constexpr"}
        out.update(config.as_dict())
        return out

    def pointer_indices(self) -> list[int]:
        tensors = [i for i, a in enumerate(self.args) if a.kind == "tensor" and not a.block]
        return tensors + [len(self.args) + i for i in range(len(self.scratch))]

    def grid_for(self, sizes: dict[str, int], config: Config,
                 params: dict[str, int] | None = None) -> tuple[int, int, int]:
        """The launch grid, always three dims (Triton's launcher reads all three).

        `params` is config.as_dict(), passed by launchers that keep it to save the work.
        """
        env = dict(sizes)
        env.update(params if params is not None else config.as_dict())
        g = eval(_grid_code(self.grid), _SCOPE, env)  # noqa: S307 - kiln's own expressions
        return g + (1,) * (3 - len(g))

    def launch_sizes(self, sizes: dict[str, int], params: dict[str, int],
                     ) -> tuple[tuple[int, int, int], list[int]]:
        """The grid (as grid_for) and each scratch buffer's numel (as Scratch.numel_for),
        in one evaluation: what binding a launch to a set of sizes needs."""
        env = dict(sizes)
        env.update(params)
        values = eval(_grid_code(self.grid + tuple(b.numel for b in self.scratch)),  # noqa: S307
                      _SCOPE, env)
        g = values[:len(self.grid)]
        return g + (1,) * (3 - len(g)), [max(1, n) for n in values[len(self.grid):]]

    def to_json(self) -> dict:
        return {
            "name": self.name, "source": self.source,
            "args": [a.to_json() for a in self.args], "tunables": list(self.tunables),
            "grid": list(self.grid), "configs": [c.to_json() for c in self.configs],
            "default": self.default.to_json(), "template": self.template, "meta": self.meta,
            "index_bits": self.index_bits, "zero_outputs": list(self.zero_outputs),
            "scratch": [b.to_json() for b in self.scratch],
        }

    @staticmethod
    def from_json(d: dict, int_args: frozenset[str] = frozenset()) -> KernelSpec:
        """The spec `to_json` wrote; `int_args`: the plan's int-argument symbols."""
        return KernelSpec(
            d["name"], d["source"], [KernelArg.from_json(a, int_args) for a in d["args"]],
            list(d["tunables"]), tuple(d["grid"]), [Config.from_json(c) for c in d["configs"]],
            Config.from_json(d["default"]), d["template"], dict(d.get("meta", {})),
            d.get("index_bits", 32), list(d.get("zero_outputs", [])),
            [Scratch.from_json(b) for b in d.get("scratch", [])],
        )


def _cdiv(x: int, y: int) -> int:
    """triton.cdiv's arithmetic (newer Triton makes it a constexpr function, slow to call)."""
    return (x + y - 1) // y


_SCOPE = {"cdiv": _cdiv, "max": max, "min": min, "int": int, "__builtins__": {}}


@functools.lru_cache(maxsize=1024)
def _grid_code(grid: tuple[str, ...]):
    return compile("(" + ", ".join(f"int({g})" for g in grid) + ",)", "<grid>", "eval")

