"""The block-scaled fp8 GEMM's kernel (kiln::fp8_linear): see template.py."""
