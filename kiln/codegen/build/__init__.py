"""Building kernels: spec, source, compile, interpreter, launch, resources."""
