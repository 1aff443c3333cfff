"""`kiln bench`: kiln beside eager PyTorch and torch.compile on one model, in one run.

Every figure a speed claim rests on comes from the same process: the same model code
and weights for each runner, and the floors (device copy bandwidth, a large matmul's
rate) measured beside them, so ratios hold even when the machine's absolute speed
drifts. subject.py is the model (a gpt-fast-style Llama written with no thought of
kiln), floors.py the floors, runners.py how each runner runs a phase, sweep.py the
phases, report.py the table, JSON, chart and the baseline check.
"""
