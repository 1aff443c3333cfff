"""Compile one (KernelSpec, Config) for a target, with or without the GPU present.

`compile_binary` returns a `Binary`: the compiled code and Triton's metadata, plus the
real resource figures read from the binary itself (shared memory from Triton;
registers and spills from cuobjdump on CUDA, from the AMDGCN text on ROCm), so the
resource check needs no GPU. `Binary.kernel()` gives a launchable CompiledKernel.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import triton

from kiln.codegen.build import grid_dependency
from kiln.codegen.build.source import load_kernel
from kiln.codegen.build.spec import Config, KernelSpec
from kiln.target import Target


@dataclass
class Resources:
    shared: int  # bytes of shared memory per block
    registers: int | None = None  # per thread
    spills: int | None = None  # spilled registers (stack / local memory words)
    threads: int = 0  # per block

    def to_json(self) -> dict:
        return {"shared": self.shared, "registers": self.registers, "spills": self.spills,
                "threads": self.threads}


@dataclass
class Binary:
    name: str
    metadata: dict  # Triton's kernel metadata (JSON-able)
    asm: dict[str, bytes | str]  # ext -> code ("cubin"/"hsaco" bytes, "ptx"/"amdgcn" text)
    resources: Resources
    binary_ext: str
    # current GPU -> CompiledKernel: its module is loaded on the GPU current at its first
    # launch, and regions of several GPUs may share one Binary
    _kernels: dict = field(default_factory=dict, repr=False)

    def kernel(self, spec: KernelSpec, config: Config):
        """A launchable triton CompiledKernel (loads the module on first launch).

        Triton's launcher reads the signature and constants from the kernel's source
        object, so a binary loaded from disk gets an equivalent one built from the spec.
        """
        import torch

        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        if device not in self._kernels:
            self._kernels[device] = _compiled_kernel(self, _LaunchSource(spec, config))
        return self._kernels[device]

    def save(self, directory: Path, stem: str) -> dict:
        """Write the binary and metadata under `directory`; returns the manifest entry."""
        directory.mkdir(parents=True, exist_ok=True)
        files = {}
        for ext in (self.binary_ext, "json"):
            path = directory / f"{stem}.{ext}"
            if ext == "json":
                path.write_text(json.dumps(self.metadata))
            else:
                path.write_bytes(self.asm[ext])
            files[ext] = path.name
        return {"name": self.name, "files": files, "binary_ext": self.binary_ext,
                "resources": self.resources.to_json()}

    @staticmethod
    def load(directory: Path, entry: dict) -> Binary:
        meta = json.loads((directory / entry["files"]["json"]).read_text())
        ext = entry["binary_ext"]
        code = (directory / entry["files"][ext]).read_bytes()
        r = entry["resources"]
        res = Resources(r["shared"], r.get("registers"), r.get("spills"), r.get("threads", 0))
        return Binary(entry["name"], meta, {ext: code}, res, ext)


class _LaunchSource:
    """What Triton's launcher reads from an ASTSource: signature, constants, arg names."""

    def __init__(self, spec: KernelSpec, config: Config):
        self.signature = spec.signature(config)
        self.constants = spec.constexprs(config)
        self.fn = SimpleNamespace(arg_names=list(self.signature))


def _compiled_kernel(b: Binary, src: _LaunchSource):
    from triton.compiler import CompiledKernel

    tmp = Path(tempfile.mkdtemp(prefix="kiln-bin-"))
    group = {}
    (tmp / f"{b.name}.json").write_text(json.dumps(b.metadata))
    group[f"{b.name}.json"] = str(tmp / f"{b.name}.json")
    (tmp / f"{b.name}.{b.binary_ext}").write_bytes(b.asm[b.binary_ext])
    group[f"{b.name}.{b.binary_ext}"] = str(tmp / f"{b.name}.{b.binary_ext}")
    return CompiledKernel(src, group, b.metadata.get("hash", b.name))


def _attrs(spec: KernelSpec) -> dict:
    # Every pointer kiln passes is 16-byte aligned (plan buffers are 256-aligned;
    # the launcher checks user tensors), which lets Triton vectorise loads.
    return {(i,): [["tt.divisibility", 16]] for i in spec.pointer_indices()}


def compile_binary(spec: KernelSpec, config: Config, target: Target) -> Binary:
    """Compile `spec` at `config` for `target` (no GPU needed). Raises on failure."""
    from triton.compiler import ASTSource

    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    source = spec.source
    if grid_dependency.applies(target):
        waiting = grid_dependency.with_grid_dependency(source, spec.name)
        if waiting is not None:
            source, options["launch_pdl"] = waiting, True
    fn = load_kernel(source, spec.name)
    src = ASTSource(fn, spec.signature(config), spec.constexprs(config), _attrs(spec))
    ck = triton.compile(src, target=target.triton_target(), options=options)
    meta = ck.metadata._asdict()
    tgt = meta["target"]
    meta["target"] = {"backend": tgt.backend, "arch": tgt.arch, "warp_size": tgt.warp_size}
    meta = json.loads(json.dumps(meta, default=_jsonable))
    ext = "cubin" if target.backend == "cuda" else "hsaco"
    asm = {k: v for k, v in ck.asm.items() if k in (ext, "ptx", "amdgcn", "ttgir")}
    res = read_resources(ck, target)
    res.threads = config.num_warps * target.warp_size
    return Binary(spec.name, meta, asm, res, ext)


def _jsonable(x):
    if isinstance(x, (set, frozenset, tuple)):
        return list(x)
    return str(x)


def read_resources(ck, target: Target) -> Resources:
    shared = int(ck.metadata.shared)
    if target.backend == "cuda":
        regs, spills = _cuda_registers(ck.asm["cubin"])
    else:
        regs, spills = _amd_registers(ck.asm.get("amdgcn", ""))
    return Resources(shared, regs, spills)


def _cuobjdump(cubin: bytes, flag: str) -> str | None:
    """cuobjdump's output for a cubin (the tool ships with Triton), None without it."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True,
                              timeout=60).stdout


def disassemble(binary: Binary) -> str | None:
    """A CUDA binary's SASS (is it on the fast path: HGMMA, LDGSTS, 16-byte loads?),
    None for other backends or without cuobjdump."""
    cubin = binary.asm.get("cubin")
    return _cuobjdump(cubin, "--dump-sass") if isinstance(cubin, bytes) else None


def _cuda_registers(cubin: bytes) -> tuple[int | None, int | None]:
    """Registers per thread and spilled words. Spills live in the stack frame (STACK;
    LOCAL counts only .local variables, which Triton kernels have none of), but a frame
    of a few bytes is also reserved where nothing spills: words count as spilled only
    when the code stores to local memory (STL)."""
    out = _cuobjdump(cubin, "--dump-resource-usage")
    m = re.search(r"REG:(\d+)\s+STACK:(\d+).*?LOCAL:(\d+)", out or "")
    if not m:
        return None, None
    frame = max(int(m.group(2)), int(m.group(3)))
    if frame:
        sass = _cuobjdump(cubin, "--dump-sass") or ""
        frame = frame if re.search(r"\bSTL\b|\bSTL\.", sass) else 0
    return int(m.group(1)), frame // 4


def _amd_registers(text: str) -> tuple[int | None, int | None]:
    regs = re.search(r"\.vgpr_count:\s+(\d+)", text)
    spills = re.search(r"\.vgpr_spill_count:\s+(\d+)", text)
    return (int(regs.group(1)) if regs else None, int(spills.group(1)) if spills else None)
