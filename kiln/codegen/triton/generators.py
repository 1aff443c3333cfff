"""Imports every region generator so each registers itself with select_kernels."""
