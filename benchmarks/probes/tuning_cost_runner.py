"""The run worker's measure (kiln.codegen.autotune.run_worker) with its parts timed, for
tuning_cost.py: buffers made, the first run (binary load, launcher), do_bench, the
outputs' check, and the whole measure ("measure": the job's time in the worker less
receiving it and replying); the seconds come back in the reply's "t"."""

import time


def measure(task: dict) -> dict:
    import torch

    from kiln.codegen.autotune.run_worker import _kernel
    from kiln.codegen.autotune.timing import make_buffers, median, timed_samples
    from kiln.codegen.autotune.verify import mismatch, outputs
    from kiln.codegen.torch_kernel import TorchKernel

    t = {}
    start = t0 = time.perf_counter()
    torch.cuda.set_device(task["device"])
    inputs, outs = make_buffers(task["buffers"], task["device"], task["seed"])
    torch.cuda.synchronize()
    t["buffers"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    kernel, sizes = _kernel(task), task["sizes"]
    kernel.run(inputs, outs, sizes)
    torch.cuda.synchronize()
    t["first run"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if task["what"] == "time":
        samples = timed_samples(kernel, inputs, outs, sizes, *(task.get("budget") or (25, 40)))
        t["do_bench"] = time.perf_counter() - t0
        t["measure"] = time.perf_counter() - start
        return {"ms": median(samples), "samples": samples, "t": t}
    inplace = task["buffers"].inplace
    want = outputs(TorchKernel(task["region"], task["device"], zeroed=True), inputs, outs,
                   sizes, inplace)
    why = mismatch(outputs(kernel, inputs, outs, sizes, inplace), want)
    t["check"] = time.perf_counter() - t0
    t["measure"] = time.perf_counter() - start
    return {"mismatch": why, "t": t}
