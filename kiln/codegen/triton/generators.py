"""Imports every region generator so each registers itself with select_kernels."""

from kiln.codegen.triton import attention, copy, matmul, pointwise, reduction  # noqa: F401
