"""Count the tensor bytes a process reads from safetensors checkpoints.

`count_reads()` wraps `safe_open` where kiln's checkpoint loaders import it: every
tensor handed out (`get_tensor`, or a lazy slice's `[...]`) adds its bytes, so a test
can say how much of a checkpoint one rank of a multi-device load read.
"""

from __future__ import annotations

import contextlib

import safetensors

LOADERS = ("kiln.models.hf", "kiln.models.deepseek_v3_checkpoint", "kiln.models.rank_weights")


def _add(counter: dict, name: str, t) -> None:
    counter["bytes"] += t.nbytes
    counter["by_name"][name] = counter["by_name"].get(name, 0) + t.nbytes


class _Slice:
    def __init__(self, part, counter, name):
        self._part, self._counter, self._name = part, counter, name

    def __getitem__(self, index):
        t = self._part[index]
        _add(self._counter, self._name, t)
        return t

    def __getattr__(self, name):  # get_shape, get_dtype
        return getattr(self._part, name)


class _Counted:
    def __init__(self, counter, *args, **kwargs):
        self._f = safetensors.safe_open(*args, **kwargs)
        self._counter = counter

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def get_tensor(self, name):
        t = self._f.get_tensor(name)
        _add(self._counter, name, t)
        return t

    def get_slice(self, name):
        return _Slice(self._f.get_slice(name), self._counter, name)

    def __getattr__(self, name):  # keys, metadata
        return getattr(self._f, name)


@contextlib.contextmanager
def count_reads():
    """{"bytes": n, "by_name": {checkpoint tensor: n}}: the tensor bytes read through
    the loaders while inside."""
    import importlib

    counter = {"bytes": 0, "by_name": {}}
    modules = [importlib.import_module(m) for m in LOADERS]
    saved = [m.safe_open for m in modules]
    for m in modules:
        m.safe_open = lambda *a, **k: _Counted(counter, *a, **k)
    try:
        yield counter
    finally:
        for m, f in zip(modules, saved):
            m.safe_open = f


def checkpoint_bytes(path) -> int:
    """Every tensor byte of the checkpoint directory `path` (what a whole load reads)."""
    from pathlib import Path

    total = 0
    for f in Path(path).glob("*.safetensors"):
        with safetensors.safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not iterable
                total += st.get_tensor(name).nbytes
    return total
