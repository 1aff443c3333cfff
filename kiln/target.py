"""Targets and their limits: what codegen must respect before a kernel can run.

Limits are per block (a CUDA thread block / a ROCm workgroup). Shared memory is the
opt-in maximum a kernel may request; codegen checks every config against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.errors import TargetError

KiB = 1024

# Rows up to which kiln's matmul kernels take their GEMV form (the matmul template and
# dispatch's folds agree through this, and kiln.models compiles a one-row decode module
# where its batch bound passes it). fp32 products run on FMA units in either form, and
# the GEMV multiplies no padding rows. fp16/bf16 tiles run on tensor cores: the GEMV's
# per-row CUDA-core products and cross-lane sums cost more than a padded 16-row tile
# from two rows on (H200, an 8B decode step at batch 4: 6.03 ms as GEMVs, 4.64 ms tiled
# with the norms unfolded; at batch 1 the GEMV wins, 4.34 ms).
GEMV_MAX_M = 8
HALF_GEMV_MAX_M = 1


def gemv_max_rows(dtype: torch.dtype) -> int:
    """Rows up to which a product in `dtype` takes the GEMV form."""
    return GEMV_MAX_M if dtype == torch.float32 else HALF_GEMV_MAX_M


@dataclass(frozen=True)
class Target:
    name: str  # canonical spelling: "cpu", "cuda:sm_90", "rocm:gfx942"
    backend: str  # "cpu" | "cuda" | "hip"
    arch: int | str | None  # 90 for sm_90, "gfx942" for ROCm
    warp_size: int
    shared_mem_per_block: int  # bytes, opt-in maximum
    registers_per_thread: int
    registers_per_block: int
    max_threads_per_block: int
    # Streaming multiprocessors (CUs on ROCm) of the target's usual part: templates size
    # their grids to fill the chip (a split reduction when there are too few tiles).
    multiprocessors: int = 132

    @property
    def is_gpu(self) -> bool:
        return self.backend in ("cuda", "hip")

    @property
    def uses_triton(self) -> bool:
        """Regions become Triton kernels (on a GPU, or run by Triton's interpreter)."""
        return self.backend != "cpu"

    @property
    def torch_device(self) -> str:
        """The torch device type tensors live on for this target (ROCm torch says 'cuda')."""
        return "cuda" if self.is_gpu else "cpu"

    def triton_target(self):
        """Triton's GPUTarget, for compiling without (or with) the GPU present."""
        from triton.backends.compiler import GPUTarget

        if self.backend == "interpret":
            return GPUTarget("cuda", self.arch, self.warp_size)  # kernels are sm_90's
        if not self.is_gpu:
            raise TargetError(f"target {self.name} has no Triton backend")
        return GPUTarget(self.backend, self.arch, self.warp_size)

    def __str__(self) -> str:
        return self.name


def _cuda(sm: int, smem_kib: int, sms: int) -> Target:
    return Target(
        name=f"cuda:sm_{sm}",
        backend="cuda",
        arch=sm,
        warp_size=32,
        shared_mem_per_block=smem_kib * KiB,
        registers_per_thread=255,
        registers_per_block=64 * KiB,
        max_threads_per_block=1024,
        multiprocessors=sms,
    )


CPU = Target("cpu", "cpu", None, 1, 0, 0, 0, 1)

TARGETS: dict[str, Target] = {
    "cpu": CPU,
    "cuda:sm_80": _cuda(80, 163, 108),  # A100
    "cuda:sm_86": _cuda(86, 99, 72),  # A10, RTX 30xx
    "cuda:sm_89": _cuda(89, 99, 58),  # L4, L40, RTX 40xx
    "cuda:sm_90": _cuda(90, 227, 132),  # H100, H200
    "cuda:sm_100": _cuda(100, 227, 148),  # B200
    # The sm_90 kernels, run by Triton's interpreter on CPU tensors: for testing
    # generated code on a machine without a GPU (slow; keep shapes tiny).
    "interpret": Target("interpret", "interpret", 90, 32, 227 * KiB, 255, 64 * KiB, 1024),
    # MI300X: 64 KiB of LDS per workgroup; 512 VGPRs per lane (256 arch + 256 acc).
    "rocm:gfx942": Target("rocm:gfx942", "hip", "gfx942", 64, 64 * KiB, 512, 128 * KiB, 1024,
                          304),
}


def detect_cuda() -> Target:
    """The target of the visible CUDA GPU; an error naming what to do when there is none."""
    import torch

    if not torch.cuda.is_available():
        raise TargetError(
            "target 'cuda' asks for the local GPU, but torch sees no CUDA device",
            hint="name an architecture to compile without a GPU (e.g. cuda:sm_90), "
            "or use target='cpu'",
        )
    if torch.version.hip:
        arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
        return get_target(f"rocm:{arch}")
    major, minor = torch.cuda.get_device_capability()
    name = f"cuda:sm_{major}{minor}"
    if name in TARGETS:
        return TARGETS[name]
    # An unlisted GPU: take the device's own shared-memory limit.
    props = torch.cuda.get_device_properties(0)
    smem = getattr(props, "shared_memory_per_block_optin", 48 * KiB)
    return Target(name, "cuda", major * 10 + minor, 32, smem, 255, 64 * KiB, 1024,
                  props.multi_processor_count)


def get_target(spec: str | Target | None) -> Target:
    """Parse a target name: 'cpu', 'cuda' (the local GPU), 'cuda:sm_90', 'rocm:gfx942'."""
    if isinstance(spec, Target):
        return spec
    if spec is not None and not isinstance(spec, str):
        raise TargetError(
            f"a target is named by a string, got {type(spec).__name__} {spec!r}",
            hint="choose one of: cuda, " + ", ".join(TARGETS),
        )
    name = (spec or "cpu").strip().lower()
    if name == "cuda":
        return detect_cuda()
    if name in TARGETS:
        return TARGETS[name]
    raise TargetError(
        f"unknown target {spec!r}",
        hint="choose one of: cuda, " + ", ".join(TARGETS),
    )
