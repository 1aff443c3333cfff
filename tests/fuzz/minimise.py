"""Shrink a failing graph while it fails the same way, and write it out as a standalone repro.

Greedy, to a fixed point: drop an output; cut a node (its value becomes a graph
input of the same shape and dtype, so everything above it goes); let a node's
consumers read one of its inputs instead when that has the same shape and dtype;
make the dynamic dim static and drop extra call sizes; shrink input dims to 1 or to
half. A candidate that no longer runs eagerly is skipped; one that still fails with
the same class (and exception type, target and stage) is kept.
"""

from __future__ import annotations

import hashlib
import textwrap
from collections.abc import Callable
from pathlib import Path

from tests.fuzz.graph import (
    DYN,
    PRELUDE,
    GraphSpec,
    Spelling,
    TensorSpec,
    dtype_key,
    infer_meta,
    live_nodes,
    module_source,
)


def failure_key(signature: str) -> str:
    """What must stay the same while shrinking: the class and target, and for a crash its
    stage, exception type and normalised message, for a fallback its region kind and
    reason, for a mismatch its kind (values, state, dtype, shape); not the op set,
    which shrinking changes on purpose."""
    parts = signature.split("|")
    if parts[0] == "crash":
        return "|".join(parts[:2] + [parts[2].split("@")[0]] + parts[3:])
    if parts[0] == "fallback":
        return signature
    return "|".join(parts[:3])


def prune(spec: GraphSpec, was_live: set[str] | None = None) -> GraphSpec:
    """Drop the nodes a change made dead (all dead nodes if `was_live` is None: a dead
    node may be what kiln trips on, so one the original had is removed on its own),
    then the leaves nothing reads."""
    live = {n.out for n in live_nodes(spec)}
    spec.nodes = [n for n in spec.nodes
                  if n.out in live or (was_live is not None and n.out not in was_live)]
    used = {v for n in spec.nodes for v in n.ins} | set(spec.outputs)
    spec.inputs = [t for t in spec.inputs if t.name in used]
    spec.params = [t for t in spec.params if t.name in used]
    spec.buffers = [t for t in spec.buffers if t.name in used]
    if spec.dyn and not any(DYN in t.shape for t in spec.inputs):
        spec.dyn = None
    return spec


def _candidates(spec: GraphSpec):
    """Smaller variants of `spec`, most shrinking first."""
    meta = infer_meta(spec)
    read = {v for n in spec.nodes for v in n.ins} | set(spec.outputs)
    for i, n in enumerate(spec.nodes):
        if n.out not in read and not n.op.startswith("buf_"):
            c = spec.clone()
            del c.nodes[i]
            yield c  # a dead node
    if len(spec.outputs) > 1:
        for o in spec.outputs:
            c = spec.clone()
            c.outputs = [x for x in c.outputs if x != o]
            yield c
    for i, n in enumerate(spec.nodes):
        if n.op.startswith("buf_"):
            c = spec.clone()
            del c.nodes[i]
            if n.out in c.outputs:
                c.outputs = [x for x in c.outputs if x != n.out] or [c.inputs[0].name]
            if any(n.out in m.ins for m in c.nodes):
                continue
            yield c
            continue
        c = spec.clone()
        shape, dt = meta[n.out]
        c.nodes = [m for m in c.nodes if m.out != n.out]
        c.inputs.append(TensorSpec(n.out, shape, dtype_key(dt), 8))
        yield c
    for n in spec.nodes:
        for src in n.ins:
            if src in meta and meta[src] == meta.get(n.out) and not n.op.startswith("buf_"):
                c = spec.clone()
                c.nodes = [m for m in c.nodes if m.out != n.out]
                for m in c.nodes:
                    m.ins = [src if x == n.out else x for x in m.ins]
                c.outputs = [src if x == n.out else x for x in c.outputs]
                yield c
    if spec.dyn is not None:
        if spec.dyn[3]:
            c = spec.clone()
            c.dyn = (*c.dyn[:3], [])
            yield c
        c = spec.clone()
        for t in c.inputs:
            t.shape = tuple(c.dyn[2] if d == DYN else d for d in t.shape)
        c.dyn = None
        yield c
    for i, t in enumerate(spec.inputs):
        for j, d in enumerate(t.shape):
            if d != DYN and d > 1:
                for new in (1, d // 2):
                    c = spec.clone()
                    c.inputs[i].shape = tuple(new if k == j else x for k, x in enumerate(t.shape))
                    yield c


def minimise(spec: GraphSpec, fails: Callable[[GraphSpec], bool], budget: int = 80) -> GraphSpec:
    """The smallest variant of `spec` found for which `fails` stays true, in at most
    `budget` calls of `fails` (each one a kiln compile)."""
    best = spec.clone()
    calls = 0
    progress = True
    while progress and calls < budget:
        progress = False
        was_live = {n.out for n in live_nodes(best)}
        for cand in _candidates(best):
            cand = prune(cand, was_live)
            if not cand.outputs or _size(cand) >= _size(best):
                continue
            try:
                infer_meta(cand)
            except Exception:  # noqa: BLE001 - no longer a valid graph
                continue
            calls += 1
            if fails(cand):
                best = cand
                progress = True
                break
            if calls >= budget:
                break
    return best


def _size(spec: GraphSpec) -> tuple:
    numel = 0
    for t in spec.inputs + spec.params + spec.buffers:
        n = 1
        for d in t.shape:
            n *= 4 if d == DYN else d
        numel += n
    return (len(spec.nodes), len(spec.outputs), spec.dyn is not None,
            len(spec.dyn[3]) if spec.dyn else 0, numel)


REPRO = '''\
# ruff: noqa
"""kiln fuzzer repro (seed {seed}): {signature}

{detail}

Run from the kiln checkout: PYTHONPATH=. python {name}
"""
{prelude}
import kiln

{module}

INPUTS = {inputs}  # (shape, dtype, high); "D" is the dynamic dim
DYN = {dyn}  # (min, max, example size, other call sizes) or None
TARGET = {target!r}
OPTIONS = {options!r}


def make_args(size, call):
    g = torch.Generator().manual_seed({seed} * 1009 + call * 7919 + (size or 0))
    out = []
    for shape, dt, high in INPUTS:
        shape = tuple(size if d == "D" else d for d in shape)
        if dt in ("f32", "f16", "bf16"):
            dtype = {{"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}}[dt]
            out.append(torch.randn(shape, generator=g).to(dtype))
        elif dt == "bool":
            out.append(torch.rand(shape, generator=g) < 0.5)
        else:
            out.append(torch.randint(0, max(high, 1), shape, generator=g))
    return tuple(out)


def rel_err(out, ref):
    if out.dtype != ref.dtype or out.shape != ref.shape:
        return float("inf")
    if not out.is_floating_point():
        return (out != ref).double().mean().item()
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def main():
    model = Fuzzed().eval()
    state = {{k: v.clone() for k, v in model.state_dict().items()}}
    dyn = None
    sizes = [None]
    if DYN is not None:
        d = kiln.Dim("D", min=DYN[0], max=DYN[1])
        dyn = tuple({{i: d for i, s in enumerate(shape) if s == "D"}} or None
                    for shape, _, _ in INPUTS)
        sizes = [DYN[2], *DYN[3]]
    exe = kiln.compile(model, make_args(sizes[0], 0), dynamic_shapes=dyn, target=TARGET,
                       options=OPTIONS)
    if ":sm_" in TARGET or ":gfx" in TARGET:  # compile-only: what each region became
        for r in exe.plan.regions:
            print(r.name, r.kind, r.notes)
        return
    device = TARGET if TARGET.startswith(("cuda", "rocm")) else "cpu"
    for call, size in enumerate(sizes):
        args = make_args(size, call)
        model.load_state_dict(state)
        with torch.no_grad():
            ref = list(model(*args)) + [b.clone() for b in model.buffers()]
        for name, t in exe.state.items():
            if name in state:
                t.copy_(state[name])
        out = list(exe(*(a.to(device) for a in args)))
        out = [t.cpu() for t in out + [exe.state[n] for n, _ in model.named_buffers()]]
        for i, (o, r) in enumerate(zip(out, ref)):
            print(f"call {{call}} (size {{size}}) output {{i}} {{o.dtype}} {{tuple(o.shape)}}: "
                  f"rel err vs eager {{rel_err(o, r):.3g}}")


if __name__ == "__main__":
    main()
'''


def write_repro(spec: GraphSpec, directory: str | Path, signature: str, detail: str,
                target: str, options: dict | None = None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tag = hashlib.sha1(signature.encode()).hexdigest()[:6]  # two classes of one seed
    name = f"repro_seed{spec.seed}_{signature.split('|')[0]}_{tag}.py"
    inputs = [(tuple(t.shape), t.dtype, t.high) for t in spec.inputs]
    body = REPRO.format(
        seed=spec.seed, signature=signature, name=name,
        detail=textwrap.indent(textwrap.shorten(detail.replace("\\", "/").replace('"""', "'''"),
                                                1500, placeholder=" ..."), "    "),
        prelude=PRELUDE, module=module_source(spec, Spelling()), inputs=inputs,
        dyn=tuple(spec.dyn) if spec.dyn else None, target=target, options=options)
    path = directory / name
    path.write_text(body)
    return path
