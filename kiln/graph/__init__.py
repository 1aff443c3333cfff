"""Graph-stage passes, in the order the pipeline runs them."""

from kiln.graph.dce import dce

GRAPH_PASSES = [dce]
