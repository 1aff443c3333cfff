"""kiln's version, in a module of its own so any stage can read it without importing
the public package (which imports every stage)."""

__version__ = "0.1.0"
