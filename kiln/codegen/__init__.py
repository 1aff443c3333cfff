"""codegen: a kernel for every region of the dispatch plan.

Three layers, each a folder named for its question, importing downward only
(build <- expr <- templates <- autotune <- select_kernels):

- build/      how a kernel is built and run, whatever generated it: the KernelSpec
              (source + arguments + grid + configs), writing and loading the source,
              compiling for a target with or without its GPU, launching
              (TritonKernel), and resources.py, which owns the guarantee that no
              kernel over the target's limits ever runs.
- expr/       how ops become Triton expressions: index maps (indexing, views), the
              Emitter that writes a region's ops at any index, the per-op rules
              (elementwise, gather), kernel parameters, the jit helpers' sources.
- templates/  how a region kind becomes a kernel: pointwise, copy, reduction (row
              kernels and their forms), matmul (and its configs), attention,
              gated_delta (kiln::gated_delta_rule), latent_attention
              (kiln::latent_attention), fp8_matmul (kiln::fp8_linear and its split
              form kiln::fp8_quantize + kiln::fp8_scaled_mm), moe
              (kiln::moe_experts and its fp8 form kiln::moe_experts_fp8), split_k.
- autotune/   which config of a kernel to run: isolated compile workers, the
              quarantine, the choice cache, timing, a decode batch's two ends.

select_kernels.py (the codegen pass) maps region kinds to templates in one table
(TEMPLATES), and the extern ops kiln writes kernels for to theirs (EXTERN_TEMPLATES);
torch_kernel.py runs a region as torch ops (the CPU target and the
extern fallback); size_switch.py runs a region by one of two kernels by the sizes it
is bound at (a decode batch whose ends each won with their own); kernel_plan.py is
the stage's IR.
"""
