"""Graph-stage passes, in the order the pipeline runs them.

1. canonicalize: one spelling per meaning (split+getitem -> slices, transpose ->
   permute) and no identity ops, so every later matcher sees a single form.
2. cse: merge repeated computations first, so a weight cast written twice is folded
   (and stored) once, and later passes see shared values as one node.
3. fold_constants: weight-only compute becomes constants while the graph still holds
   the user's own views of them (folding sees through canonical views).
4. propagate_reshapes: move permutes / reshapes down through elementwise ops so
   inverse pairs cancel; it may leave reshape chains behind...
5. collapse_dims: ...which this composes, so no reshape reads a reshape and no
   collapse -> expand -> collapse round trip remains.
6. split_fp8_linear: an fp8 linear over more than a decode step's tokens becomes
   quantise-once + the block-scaled GEMM (two kernels instead of one that requantises
   x per output tile).
7. patterns: label RMSNorm / RoPE / SwiGLU / attention on the final structure (labels
   do not survive rewrites, so they come after every rewriting pass).
8. dce: drop whatever the rewrites left unused; establishes no-dead-code last so the
   earlier passes need not clean up after each other.
"""

from kiln.graph.canonicalize import canonicalize
from kiln.graph.collapse_dims import collapse_dims
from kiln.graph.cse import cse
from kiln.graph.dce import dce
from kiln.graph.fold_constants import fold_constants
from kiln.graph.patterns import patterns
from kiln.graph.propagate_reshapes import propagate_reshapes
from kiln.graph.split_fp8_linear import split_fp8_linear

GRAPH_PASSES = [canonicalize, cse, fold_constants, propagate_reshapes, collapse_dims,
                split_fp8_linear, patterns, dce]
