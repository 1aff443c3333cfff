"""The grouped MoE GEMM's kernel (kiln::moe_experts): see template.py."""
