"""The host (CPU) cost of kiln's GPU runtime path per kernel, measured without a GPU.

A prefill at 128 tokens on an H100 is host-bound when each launch costs tens of
microseconds of Python (kiln issue 10): this measures that cost here, on the CPU.
`kiln bench`'s gpt-fast-style Llama at Llama-3-8B's shape (fewer layers; the model on
the meta device) is compiled for `cuda:sm_90` (compile-only works without a GPU) with a
dynamic sequence dim, then its Program runs with
- every tensor on the meta device (no data, no compute: what is left is host work),
- Triton's final launch (the C launcher behind CompiledKernel.run) a no-op, and the
  driver's current device / stream answered by stubs,
- torch regions' ops on meta tensors (ATen dispatch without compute).

What it reports (microseconds, the least of --repeats means of --iters calls each):
- `call`: a whole CompiledModule call at one size, repeated (the prefill loop's case),
  and per kernel step;
- `alternating_sizes_call`: calls alternating between two sizes;
- `new_size_call`: a call at sizes the module keeps nothing for (all bound afresh);
- `guards`: checking the arguments and binding the sizes;
- `arena_views`: laying out the arena and making its views at sizes not kept;
- `runtime`: Program.run with every kernel a no-op (the runtime's own per-step work);
- `triton` / `torch`: Program.run with only that kind's kernels real, minus `runtime`,
  per kernel of that kind (and per op for torch regions); torch regions run with
  ATen's calls stubbed (each returns its first result), so what is left is kiln's work
  around the ops. The `call` figures include torch regions that way at one size, and
  with torch regions as no-ops once sizes change.

It does not measure the C launcher itself (argument parsing and cuLaunchKernel, a few
microseconds per launch on an H100) nor ATen's CUDA-side work for torch ops.

    PYTHONPATH=. python benchmarks/host_overhead.py --layers 4 --out host.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections import Counter

import torch

import kiln
import kiln.compiled_module
from kiln.bench import subject
from kiln.codegen.torch_kernel import TorchKernel
from kiln.ir.ops import resolve
from kiln.runtime.memory_plan import Arena

META = torch.device("meta")


def _noop_launch(*args, **kwargs) -> None:
    """Stands in for Triton's C launcher: takes the arguments, launches nothing."""


class _StubDriver:
    """What CompiledKernel's launch path asks Triton's driver for, without a GPU."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def _stub_triton_launcher(kernel) -> None:
    """Make `kernel`'s CompiledKernel launch a no-op: its handles look loaded and its
    launcher (`CompiledKernel.run`) does nothing."""
    ck = kernel.binary.kernel(kernel.spec, kernel.config)
    ck.module = object()
    ck.function = 0
    if hasattr(type(ck), "run") and isinstance(type(ck).run, property):
        ck._run = _noop_launch  # triton >= 3.4: `run` reads `_run`
    else:
        ck.run = _noop_launch


class NoopKernel:
    """A kernel that launches nothing: the runtime's own per-step cost is what remains.
    Binding still binds the real kernel (a call at new sizes pays for that)."""

    def __init__(self, kernel):
        self.kind = kernel.kind
        self.region = kernel.region
        self.kernel = kernel

    def run(self, inputs, outs, env) -> None:
        pass

    def bind(self, env, fixed, device):
        self.kernel.bind(env, fixed, device)
        return _noop_launch


class _Recorded:
    """An ATen op that runs once (on meta tensors) and then returns that first result:
    what remains of a torch region's call is kiln's own work around its ops."""

    def __init__(self, op):
        self.op = op
        self.result = None

    def __call__(self, *args, **kwargs):
        if self.result is None:
            self.result = self.op(*args, **kwargs)
        return self.result


def _torch_kernel_without_aten(region):
    """A TorchKernel on meta tensors whose ATen calls are _Recorded (one size only)."""
    from kiln.codegen import torch_kernel as tk

    saved = tk.callable_for, tk.out_overload, tk.resolve
    tk.callable_for = lambda name: _Recorded(saved[0](name))
    tk.out_overload = lambda name: (lambda op: op and _Recorded(op))(saved[1](name))
    tk.resolve = lambda name: _Recorded(saved[2](name))
    try:
        return TorchKernel(region, META)
    finally:
        tk.callable_for, tk.out_overload, tk.resolve = saved


def host_only(module) -> dict[str, dict]:
    """Rewire `module` (compiled for a GPU) to run on meta tensors with no-op launches.
    Returns its kernels by region name in two forms: "triton" (the real kernels, the
    C launch a no-op) and "torch" (torch regions with ATen stubbed)."""
    import triton

    triton.runtime.driver.set_active(_StubDriver())
    kiln.compiled_module.device_present = lambda target: True
    prog = module.program
    prog.device = META
    prog.arena = Arena(prog.mem, prog.plan, META)
    forms = {"triton": {}, "torch": {}}
    for name, k in prog.kplan.kernels.items():
        if k.kind == "torch":
            forms["torch"][name] = _torch_kernel_without_aten(k.region)
        elif k.kind == "triton":
            _stub_triton_launcher(k)
            forms["triton"][name] = k
    return forms


def use_kernels(prog, forms: dict[str, dict], *real: str) -> None:
    """Run the kernels of the named forms, no-ops for every other region."""
    chosen = {name: k for form in real for name, k in forms[form].items()}
    noop = {name: k for form in ("triton", "torch") for name, k in forms[form].items()}
    for name, k in noop.items():
        prog.set_kernel(name, chosen.get(name) or NoopKernel(k))


def timed_us(fn, iters: int, repeats: int) -> float:
    """The least over `repeats` of the mean microseconds of `iters` calls of fn() (the
    least disturbed by other work on a shared machine, as timeit advises)."""
    fn()
    means = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        means.append((time.perf_counter_ns() - t0) / iters / 1e3)
    return min(means)


def compile_prefill(layers: int, dtype: torch.dtype):
    s = subject.PRESETS["llama3-8b"].with_(layers=layers)
    with torch.device("meta"):
        model = subject.Subject(s).to(dtype).eval()
    seq = kiln.Dim("seq", min=2, max=s.max_len)
    ex = (torch.zeros(1, 16, dtype=torch.long, device=META), torch.arange(16, device=META))
    t0 = time.perf_counter()
    module = kiln.compile(model, ex, dynamic_shapes=({1: seq}, {0: seq}),
                          target="cuda:sm_90", options={"tune": "none"})
    return module, time.perf_counter() - t0


def _forget_sizes(prog) -> None:
    """Drop what the program keeps per set of sizes: the next call binds afresh."""
    prog.arena._cache_key = None
    getattr(prog, "_bound", {}).clear()


def _inputs(tokens: int):
    return (torch.zeros(1, tokens, dtype=torch.long, device=META),
            torch.arange(tokens, device=META))


def measure(module, forms: dict[str, dict], tokens: int, other: int, iters: int,
            repeats: int) -> dict:
    prog = module.program
    n_triton, n_torch = len(forms["triton"]), len(forms["torch"])
    torch_ops = Counter()
    for k in forms["torch"].values():
        for op in k.region.ops:
            view = op.target == "getitem" or getattr(resolve(op.target), "is_view", False)
            torch_ops["view" if view else "compute"] += 1
    n_ops = sum(torch_ops.values())
    args = _inputs(tokens)
    flat = list(args)
    env = prog.bind(flat)
    state = module.state
    steps = len(prog.plan.regions)

    def run_with(*real: str) -> float:
        use_kernels(prog, forms, *real)
        with torch.no_grad():
            return timed_us(lambda: prog.run(flat, state, env), iters, repeats)

    def per(total: float, n: int) -> float | None:
        return total / n if n else None

    runtime = run_with()
    triton_us = run_with("triton") - runtime
    torch_us = run_with("torch") - runtime
    with torch.no_grad():
        use_kernels(prog, forms, "triton", "torch")
        call = timed_us(lambda: module(*args), iters, repeats)
        guards = timed_us(lambda: prog.bind(flat, prog.plan.user_inputs), iters * 10, repeats)
        arena = timed_us(lambda: (_forget_sizes(prog), prog.arena.views(env)), iters, repeats)
        use_kernels(prog, forms, "triton")  # recorded ATen results fit one size only
        alt = _inputs(other)
        pair = timed_us(lambda: (module(*args), module(*alt)), max(1, iters // 2), repeats)
        new_size = timed_us(lambda: (_forget_sizes(prog), module(*args)), iters, repeats)
    return {
        "tokens": tokens, "steps": steps, "kernels": {"triton": n_triton, "torch": n_torch},
        "torch_ops": dict(torch_ops),
        "call_us": call, "call_us_per_step": call / steps,
        "alternating_sizes_call_us": pair / 2,
        "new_size_call_us": new_size,
        "guards_us": guards,
        "arena_views_us": arena, "arena_values": len(prog.mem.slot_of),
        "runtime_us": runtime, "runtime_us_per_step": runtime / steps,
        "triton_us_per_kernel": per(triton_us, n_triton),
        "torch_us_per_region": per(torch_us, n_torch),
        "torch_us_per_op": per(torch_us, n_ops),
    }


def report(r: dict) -> str:
    def f(v):
        return "-" if v is None else f"{v:.2f}"

    return "\n".join([
        f"prefill {r['tokens']} host cost, {r['steps']} steps {r['kernels']}, "
        f"torch ops {r['torch_ops']}",
        f"  call, same size          {f(r['call_us'])} us = {f(r['call_us_per_step'])} us/step",
        f"  call, sizes alternating  {f(r['alternating_sizes_call_us'])} us "
        "(torch regions no-ops from here)",
        f"  call, at unseen sizes    {f(r['new_size_call_us'])} us",
        f"  guards (bind sizes)      {f(r['guards_us'])} us",
        f"  arena views, new sizes   {f(r['arena_views_us'])} us for {r['arena_values']} values",
        f"  runtime, no-op kernels   {f(r['runtime_us'])} us = "
        f"{f(r['runtime_us_per_step'])} us/step",
        f"  triton kernel            {f(r['triton_us_per_kernel'])} us each",
        f"  torch region, kiln side  {f(r['torch_us_per_region'])} us each = "
        f"{f(r['torch_us_per_op'])} us/op",
    ])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--other", type=int, default=96, help="the second size of the "
                   "alternating calls (first call at a new size)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", help="write the figures as JSON here")
    a = p.parse_args()
    module, compile_s = compile_prefill(a.layers, torch.float16)
    forms = host_only(module)
    r = measure(module, forms, a.tokens, a.other, a.iters, a.repeats)
    import triton

    r.update(layers=a.layers, compile_s=compile_s, torch=torch.__version__,
             triton=triton.__version__, python=platform.python_version(),
             machine=platform.processor() or platform.machine())
    print(report(r))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(r, fh, indent=1)
            fh.write("\n")


if __name__ == "__main__":
    main()
