"""kiln.compile, the compiled call and explain under hostile input: wrong arguments,
wrong dynamic_shapes, bad targets and options, models that are not modules, cannot be
exported, raise in forward or are in train mode; wrong arguments at call time. Each
case is refused with a clean KilnError, or compiles and matches eager (contract.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.errors import (
    AffinityError,
    ArgumentError,
    DeviceError,
    DTypeError,
    ExportError,
    IndexOutOfRangeError,
    KilnError,
    ShapeError,
    TargetError,
    UnsupportedOpError,
)
from tests.no_raw_exceptions.contract import (
    GPU_MODULE_CALL,
    NO_GPU,
    call_and_compare,
    kiln_error_or,
    refused,
)

X = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
B = kiln.Dim("B", min=2, max=16)


class Add(torch.nn.Module):
    def forward(self, x, y):
        return x + y


class Lin(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 5)

    def forward(self, x):
        return F.relu(self.proj(x))


class Raises(torch.nn.Module):
    def __init__(self, exc: Exception):
        super().__init__()
        self.exc = exc

    def forward(self, x):
        raise self.exc


class Returns(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class Branchy(torch.nn.Module):
    def forward(self, x):
        return x + 1 if x.sum() > 0 else x - 1


class Dropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)
        self.norm = torch.nn.BatchNorm1d(3)

    def forward(self, x):
        return self.norm(self.drop(x))


class BatchStats(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(3)

    def forward(self, x):
        return self.norm(x) * 2


class InPlaceInput(torch.nn.Module):
    def forward(self, x):
        x.add_(1)
        return x


class ScaleBy(torch.nn.Module):
    def forward(self, x, n: int):
        return x * n


def _compile(model, args=(X, X), **kw):
    return lambda: kiln.compile(model, args, **kw)


# (id, the call, the KilnError it must raise)
REFUSED = [
    ("a function, not a module", _compile(lambda x, y: x + y), ExportError),
    ("None as the model", _compile(None), ExportError),
    ("a module class, not an instance", _compile(Add), ExportError),
    ("a CompiledModule as the model", lambda: kiln.compile(kiln.compile(Add(), (X, X)),
                                                           (X, X)), ExportError),
    ("a scripted module", _compile(torch.jit.script(Lin()), (X,)), ExportError),
    ("args None (compiles lazily), called with too few",  # bound to forward's signature
     lambda: kiln.compile(Add(), None)(X), ArgumentError),
    ("too few args", _compile(Add(), args=(X,)), ExportError),
    ("too many args", _compile(Add(), args=(X, X, X)), ExportError),
    ("args as a dict", _compile(Add(), args={"x": X, "y": X}), ExportError),
    ("kwargs as a list", lambda: kiln.compile(Add(), (X,), [X]), ArgumentError),
    ("an unknown keyword", lambda: kiln.compile(Add(), (X, X), {"z": X}), ExportError),
    ("numpy arrays as args", _compile(Add(), args=(X.numpy(), X.numpy())), ExportError),
    ("dynamic_shapes an int", _compile(Add(), dynamic_shapes=3), KilnError),
    ("dynamic_shapes a str", _compile(Add(), dynamic_shapes="B"), KilnError),
    ("dynamic_shapes too short", _compile(Add(), dynamic_shapes=[{0: B}]), ShapeError),
    ("dynamic_shapes by unknown names", _compile(Add(), dynamic_shapes={"q": {0: B}, "y": None}),
     ShapeError),
    ("a dim past the rank", _compile(Add(), dynamic_shapes=({5: B}, None)), ShapeError),
    ("a dim keyed by a str", _compile(Add(), dynamic_shapes=({"a": B}, None)), KilnError),
    ("a dim given as an int", _compile(Add(), dynamic_shapes=({0: 5}, None)), KilnError),
    ("a Dim for a whole tensor", _compile(Add(), dynamic_shapes=(B, None)), ShapeError),
    ("an example outside its Dim", _compile(Add(), args=(X[:1], X[:1]),
                                            dynamic_shapes=({0: B}, {0: B})), ShapeError),
    ("a dynamic dim the model pins", _compile(Returns(lambda x: x.view(12)), (X,),
                                              dynamic_shapes=({0: B},)), ShapeError),
    ("target 90", _compile(Add(), target=90), TargetError),
    ("target ['cpu']", _compile(Add(), target=["cpu"]), TargetError),
    ("target 'tpu'", _compile(Add(), target="tpu"), TargetError),
    ("target 'cuda:sm_999'", _compile(Add(), target="cuda:sm_999"), TargetError),
    ("options a list", _compile(Add(), options=["tune"]), ArgumentError),
    ("an unknown option", _compile(Add(), options={"tunee": "none"}), ArgumentError),
    ("a bad tune mode", _compile(Add(), options={"tune": "fastest"}), ArgumentError),
    ("compile_to an unknown stage", _compile(Add(), compile_to="lower"), KilnError),
    ("compile_to 3", _compile(Add(), compile_to=3), KilnError),
    ("fallback 5", _compile(Add(), fallback=5), ArgumentError),
    ("dump_ir 3", _compile(Add(), dump_ir=3), ArgumentError),
    ("parallel a list", _compile(Add(), parallel=[2]), ArgumentError),
    ("parallel tp 0", _compile(Add(), parallel={"tp": 0}), ArgumentError),
    ("parallel unknown key", _compile(Add(), parallel={"tq": 2}), ArgumentError),
    ("devices 'x'", _compile(Add(), devices="x"), ArgumentError),
    ("devices -1", _compile(Add(), devices=-1), ArgumentError),
    ("device_map a list", _compile(Add(), device_map=[1]), ArgumentError),
    ("pins a list", _compile(Lin(), (X,), pins=["proj.weight"]), ArgumentError),
    ("pins an unknown weight", _compile(Lin(), (X,), pins={"proj.w": 0}), ArgumentError),
    ("pins to an undeclared device", _compile(Lin(), (X,), pins={"proj.weight": 5}),
     DeviceError),
    ("inputs on two devices", _compile(Add(), args=(X, X.to("meta"))), AffinityError),
    *[(f"forward raises {type(e).__name__}", _compile(Raises(e), (X,)), ExportError)
      for e in (ValueError("v"), RuntimeError("r"), AssertionError("a"), TypeError("t"),
                KeyError("k"), IndexError("i"), NotImplementedError())],
    ("a branch on a tensor's value", _compile(Branchy(), (X,)), ExportError),
    ("returns a str", _compile(Returns(lambda x: "text"), (X,)), UnsupportedOpError),
    ("returns a Python int", _compile(Returns(lambda x: x.shape[0]), (X,)),
     UnsupportedOpError),
    (".item() in forward", _compile(Returns(lambda x: x * x.sum().item()), (X,)),
     UnsupportedOpError),
    ("a data-dependent size", _compile(Returns(lambda x: torch.nonzero(x)), (X,)),
     UnsupportedOpError),
    ("a data-dependent size pinned by a reshape",
     _compile(Returns(lambda x: x[x > 0].reshape(2, 3)), (X,)), UnsupportedOpError),
    ("numpy inside forward", _compile(Returns(lambda x: torch.from_numpy(x.numpy()) + 1),
                                      (X,)), ExportError),
    ("a random op with fallback='error'",
     _compile(Returns(lambda x: x + torch.rand_like(x)), (X,), fallback="error"),
     UnsupportedOpError),
    ("an input mutated in place", _compile(InPlaceInput(), (X.clone(),)),
     UnsupportedOpError),
    ("train mode with dropout", _compile(Dropout().train(), (X,)), ArgumentError),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_compile_refuses_with_a_clean_error(case):
    what, fn, cls = case
    refused(fn, cls, what=what)


class PickRow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(12, 3), requires_grad=False)

    def forward(self, x):
        return self.table[x.argmax()], F.group_norm(x.t()[None], 3)


# (id, model, example args, compile keywords): compile, then match eager
WORKS = [
    ("returns its input", Returns(lambda x: x), (X,), {}),
    ("returns a constant", Returns(lambda x: torch.ones(3)), (X,), {}),
    ("returns nested containers", Returns(lambda x: {"a": x + 1, "b": [x * 2, (x,)]}),
     (X,), {}),
    ("returns nothing", Returns(lambda x: ()), (X,), {}),
    ("complex math inside", Returns(lambda x: torch.view_as_complex(x[:, :2].contiguous())
                                    .abs()), (X,), {}),
    ("float64 inside", Returns(lambda x: (x.double() * 2).sum()), (X,), {}),
    ("sort", Returns(lambda x: torch.sort(x, -1)), (X,), {}),
    ("empty tensors", Add(), (torch.randn(0, 3), torch.randn(0, 3)), {}),
    ("0-dim tensors", Add(), (torch.tensor(1.5), torch.tensor(2.0)), {}),
    ("uint8", Add(), (torch.tensor([1, 200], dtype=torch.uint8),) * 2, {}),
    ("Dim.AUTO", Add(), (X, X), {"dynamic_shapes": ({0: kiln.Dim.AUTO},) * 2}),
    ("a non-tensor argument", ScaleBy(), (X, 3), {}),
    ("a row picked by argmax, group_norm of a transpose", PickRow(), (torch.randn(4, 3),),
     {}),
    ("train mode allowed", BatchStats().train(), (X,), {"allow_train": True}),
    ("target None and 'CPU'", Lin(), (X,), {"target": "CPU"}),
]


@pytest.mark.parametrize("case", WORKS, ids=[c[0] for c in WORKS])
@pytest.mark.filterwarnings("ignore::kiln.errors.KilnWarning")
def test_compile_works_and_matches_eager(case):
    _, model, args, kw = case
    exe = kiln.compile(model, args, **kw)
    call_and_compare(exe, model, args)
    assert exe.explain(kernels=True)


@pytest.fixture(scope="module")
def dynamic_add():
    return kiln.compile(Add(), (X, X), dynamic_shapes=({0: B}, {0: B}))


# (id, call args, call kwargs, the KilnError it must raise)
WRONG_CALLS = [
    ("no arguments", (), {}, ArgumentError),
    ("one too few", (X,), {}, ArgumentError),
    ("one too many", (X, X, X), {}, ArgumentError),
    ("a str", ("a", X), {}, ArgumentError),
    ("None", (None, X), {}, ArgumentError),
    ("a float", (1.0, X), {}, ArgumentError),
    ("a list", ([1.0], X), {}, ArgumentError),
    ("a numpy array", (X.numpy(), X), {}, ArgumentError),
    ("a tuple", ((X,), X), {}, ArgumentError),
    ("float64", (X.double(), X), {}, DTypeError),
    ("int64", (X.long(), X), {}, DTypeError),
    ("bool", (X > 0, X), {}, DTypeError),
    ("complex", (torch.randn(4, 3, dtype=torch.cfloat), X), {}, DTypeError),
    ("an extra dim", (X[None], X[None]), {}, ShapeError),
    ("a dim too few", (X[0], X[0]), {}, ShapeError),
    ("a static size changed", (torch.randn(4, 5), torch.randn(4, 5)), {}, ShapeError),
    ("below the Dim's min", (X[:1], X[:1]), {}, ShapeError),
    ("above the Dim's max", (torch.randn(17, 3),) * 2, {}, ShapeError),
    ("one Dim, two sizes", (torch.randn(3, 3), X), {}, ShapeError),
    ("an empty dim", (X[:0], X[:0]), {}, ShapeError),
    ("on the meta device", (X.to("meta"), X.to("meta")), {}, DeviceError),
    ("a keyword for a positional", (X,), {"y": X}, ArgumentError),
    ("an unknown keyword", (X, X), {"z": X}, ArgumentError),
]


@pytest.mark.parametrize("case", WRONG_CALLS, ids=[c[0] for c in WRONG_CALLS])
def test_wrong_calls_are_refused(dynamic_add, case):
    what, args, kwargs, cls = case
    refused(lambda: dynamic_add(*args, **kwargs), cls, what=what)


def test_calls_eager_accepts_work(dynamic_add):
    y = torch.randn(3, 4).t()  # non-contiguous
    for args in ((y, y), (torch.randn(1, 3).expand(5, 3), torch.randn(5, 3)),
                 (torch.nn.Parameter(X), X.clone().requires_grad_())):
        call_and_compare(dynamic_add, Add(), args)


def test_structured_and_non_tensor_arguments():
    class Nest(torch.nn.Module):
        def forward(self, xs, d, n: int):
            return xs[0] + xs[1] * d["k"] * n

    exe = kiln.compile(Nest(), ([X, X], {"k": X}, 2))
    call_and_compare(exe, Nest(), ([X, X], {"k": X}, 2))
    for what, args in [("a tuple for the list", ((X, X), {"k": X}, 2)),
                       ("a shorter list", ([X], {"k": X}, 2)),
                       ("another key", ([X, X], {"j": X}, 2)),
                       ("an extra key", ([X, X], {"k": X, "j": X}, 2)),
                       ("another int", ([X, X], {"k": X}, 3)),
                       ("a str for the int", ([X, X], {"k": X}, "2"))]:
        refused(lambda args=args: exe(*args), ArgumentError, what=what)


def test_an_index_past_its_dim_at_call_time():
    class Embed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 3)

        def forward(self, ids):
            return self.emb(ids)

    model = Embed().eval()
    exe = kiln.compile(model, (torch.tensor([1, 2]),))
    refused(lambda: exe(torch.tensor([1, 8])), IndexOutOfRangeError)
    call_and_compare(exe, model, (torch.tensor([7, 0]),))


def test_compile_only_targets_refuse_calls_but_explain():
    exe = kiln_error_or(lambda: kiln.compile(Lin(), (X,), target="cuda:sm_90",
                                             options={"tune": "none"}))
    assert exe is not None
    refused(lambda: exe(X), GPU_MODULE_CALL)
    if NO_GPU:
        refused(lambda: exe.cuda_graphs(), TargetError)
    assert "cuda:sm_90" in exe.explain(kernels=True)
