"""The autotuner's parts: isolated compile workers, the quarantine, the choice cache, timing.

Why a package of its own (DESIGN.md failure 5): a Triton config (num_warps 8/16) hit a
C++ assertion in Triton's compiler, and the abort killed the whole compile. Triton's
own autotuner skips configs that raise OutOfResources, but any other compiler failure
ends the run, and an abort or a hang ends the process. kiln tunes so that a bad config
costs only itself:

- worker_pool.py:    each candidate compiles in a reused worker process with a timeout;
                     a crash or hang ends that worker only, and it is replaced
                     (compile_worker.py is the worker process's side).
- quarantine.py:     which (kernel, config, Triton version, target) crashed, hung or did
                     not fit, persisted in KILN_CACHE_DIR so it is never tried again.
- candidates.py:     the configs a tune mode tries.
- timing.py:         with the target's GPU present, candidates (and the extern torch
                     form) are timed on random inputs of the example's sizes.
- both_ends.py:      a decode batch timed at both ends: one kernel, or each end its own
                     (a SizeSwitch between them).
- cache.py:          the chosen config and its binary, so a second compile tunes nothing.
- tuner.py:          puts them together; kiln.codegen.build.resources says which
                     configs fit the target, before compiling and after.
"""
