"""Imports every region generator so each registers itself with select_kernels."""

from kiln.codegen.triton import pointwise  # noqa: F401
