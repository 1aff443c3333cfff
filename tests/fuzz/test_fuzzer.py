"""The fuzzer's own tests: reproducible graphs, the float64 re-check, the minimiser and
its repro, each against planted bugs (a stand-in compile function) so they can fail."""

from __future__ import annotations

import runpy

import torch
from torch.overrides import TorchFunctionMode

from tests.fuzz.compare import verdict
from tests.fuzz.generate import generate
from tests.fuzz.graph import Spelling, infer_meta, make_args, module_source
from tests.fuzz.minimise import failure_key, minimise, write_repro
from tests.fuzz.oracle import Config, check, normalise


def test_same_seed_same_graph():
    for seed in (0, 7, 123):
        a, b = generate(seed), generate(seed)
        assert module_source(a, Spelling()) == module_source(b, Spelling())
        size = a.call_sizes()[0]
        for x, y in zip(make_args(a, size, 0), make_args(b, size, 0)):
            assert torch.equal(x, y)
    sources = {module_source(generate(s), Spelling()) for s in range(20)}
    assert len(sources) == 20


def test_graphs_cover_the_catalogue_and_dynamic_dims():
    specs = [generate(s) for s in range(60)]
    ops = {n.op for s in specs for n in s.nodes}
    assert {"sdpa", "matmul_w", "softmax", "buf_index_copy", "reshape", "cast"} <= ops
    assert any(s.dyn and len(s.call_sizes()) >= 2 for s in specs)
    for s in specs:
        assert 1 <= len(s.nodes) <= 15
        infer_meta(s)  # every generated graph runs eagerly at two dynamic sizes


class _Uses(TorchFunctionMode):
    def __init__(self, fn):
        super().__init__()
        self.fn, self.seen = fn, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen |= func is self.fn
        return func(*args, **(kwargs or {}))


def _uses(model, args, fn) -> bool:
    with torch.no_grad(), _Uses(fn) as mode:
        model(*args)
    return mode.seen


class _EagerExe:
    """A stand-in compiled module: runs the model eagerly, optionally off by 1%."""

    def __init__(self, model, skew: float):
        self.model, self.skew = model, skew
        self.state = dict(model.named_buffers())

    def __call__(self, *args):
        with torch.no_grad():
            outs = self.model(*args)
        return tuple(o * (1 + self.skew) if o.is_floating_point() else o for o in outs)


def _planted(fn, crash: bool):
    def compile_fn(model, args, dynamic_shapes=None, target="cpu", options=None):
        hit = _uses(model, args, fn)
        if hit and crash:
            raise RuntimeError(f"planted bug: {fn.__name__} at node 12")
        return _EagerExe(model, 0.01 if hit else 0.0)
    return compile_fn


def _seed_with(op: str, at_least: int = 6) -> int:
    return next(s for s in range(500)
                if op in generate(s).ops() and len(generate(s).nodes) >= at_least)


def _shrinks(op, fn, crash, cls, tmp_path):
    seed = _seed_with(op)
    spec = generate(seed)
    cfg = Config(targets=("cpu",), compile_fn=_planted(fn, crash))
    found = check(spec, cfg).worst
    assert found.cls == cls, found
    key = failure_key(found.signature)

    def fails(s):
        return any(failure_key(o.signature) == key for o in check(s, cfg).outcomes)

    small = minimise(spec, fails)
    assert len(small.nodes) < len(spec.nodes)
    assert op in small.ops() and len(small.nodes) <= 2, small.ops()
    assert check(small, cfg).worst.cls == cls
    path = write_repro(small, tmp_path, found.signature, found.detail, "cpu")
    text = path.read_text()
    assert "kiln.compile" in text and f"seed {seed}" in text
    return path


def test_minimiser_shrinks_a_planted_crash_and_its_repro_runs(tmp_path, capsys):
    path = _shrinks("tanh", torch.tanh, True, "crash", tmp_path)
    runpy.run_path(str(path), run_name="__main__")  # the real kiln: compiles and compares
    assert "rel err vs eager" in capsys.readouterr().out


def test_minimiser_keeps_a_planted_mismatch(tmp_path):
    _shrinks("sin", torch.sin, False, "mismatch", tmp_path)


def test_low_precision_rounding_is_not_a_mismatch():
    torch.manual_seed(0)
    x = torch.randn(64, 64, dtype=torch.float64)
    exact = (x @ x).sum(-1)
    eager = (x.half() @ x.half()).sum(-1)  # rounds every step in fp16
    kiln_like = exact.half()  # rounds once: far from eager, closer to the truth
    assert not verdict(kiln_like, eager, lambda: (exact, [exact]))[0]
    assert verdict((exact * 1.2).half(), eager, lambda: (exact, [exact]))[0]


def test_a_near_tie_argmax_is_not_a_mismatch_but_a_wrong_one_is():
    ref = torch.tensor([1, 2, 3])
    eager = torch.tensor([1, 2, 3])
    flipped = torch.tensor([1, 2, 0])
    shaky = (ref, [torch.tensor([1, 2, 0])])  # the reference itself flips when perturbed
    assert not verdict(flipped, eager, lambda: shaky)[0]
    assert verdict(flipped, eager, lambda: (ref, [ref, ref]))[0]


def test_signatures_ignore_names_and_sizes():
    a = normalise("shape mismatch in %v12: [8, 16] vs [8, 1] at /x/y/kiln/a.py line 3\nmore")
    b = normalise("shape mismatch in %v3: [4, 2] vs [4, 1] at /q/kiln/b.py line 9")
    assert a == b


def test_float64_reference_promotes_integer_math_to_float64():
    """atan of an int64 is a float of the default dtype: the float64 re-check must make
    it float64, or a later linear with float64 weights fails (seed 600714 did)."""
    from tests.fuzz.generate import generate
    from tests.fuzz.graph import build_module, make_args
    from tests.fuzz.oracle import Reference

    spec = generate(600714)
    state = {k: v.clone() for k, v in build_module(spec).state_dict().items()}
    ref = Reference(spec, state, make_args(spec, spec.call_sizes()[0], 0))
    outs = ref._run(ref.args)
    assert {t.dtype for t in outs} == {torch.float64}
    assert torch.get_default_dtype() == torch.float32
