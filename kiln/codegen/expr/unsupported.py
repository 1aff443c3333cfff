"""CodegenUnsupported on its own, so the index arithmetic (indexing.py, below values.py)
can decline a region too."""


class CodegenUnsupported(Exception):
    """This region (or this op in it) has no Triton form kiln can generate: the template
    declines with this message, and the region runs extern with it as its note."""
