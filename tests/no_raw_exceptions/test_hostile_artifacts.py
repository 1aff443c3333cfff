"""CompiledModule.save / kiln.load under hostile input: paths that are not paths or are
blocked, missing, garbage and truncated files, every manifest entry dropped or of the
wrong type, a wrong target; and the loaded module called wrongly. Each is a clean
KilnError (contract.py), or loads and matches eager.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import kiln
from kiln.errors import ArgumentError, ArtifactError, DTypeError, ShapeError, TargetError
from tests.no_raw_exceptions.contract import NO_GPU, call_and_compare, kiln_error_or, refused


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 4)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps.add_(1)
        return torch.relu(self.proj(x)).sum(-1), self.steps * 1


B = kiln.Dim("B", min=1, max=8)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = Net().eval()
    path = tmp_path_factory.mktemp("good") / "net.kiln"
    kiln.compile(model, (torch.randn(2, 3),), dynamic_shapes=({0: B},)).save(path)
    return path, model


@pytest.fixture
def copy_of(saved, tmp_path):
    path, _ = saved

    def make(name: str):
        dst = tmp_path / name
        shutil.copytree(path, dst)
        return dst
    return make


def test_save_load_round_trip_matches_eager(saved, tmp_path):
    path, model = saved
    loaded = kiln.load(path)
    call_and_compare(loaded, model, (torch.randn(5, 3),))
    loaded.save(tmp_path / "again.kiln")  # a loaded module saves too
    call_and_compare(kiln.load(tmp_path / "again.kiln", target="cpu"), model,
                     (torch.randn(1, 3),))
    assert "B" in loaded.explain(kernels=True)


@pytest.mark.parametrize("path", [None, 3, "", ["x.kiln"], b"x.kiln"])
def test_paths_that_are_not_paths(saved, path):
    refused(lambda: kiln.load(path), ArtifactError)
    refused(lambda: kiln.load(saved[0]).save(path), ArtifactError)


def test_blocked_missing_and_wrong_kind_of_paths(saved, tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty.kiln").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    module = kiln.load(saved[0])
    for what, fn in [
        ("load of a missing path", lambda: kiln.load(tmp_path / "missing.kiln")),
        ("load of a file", lambda: kiln.load(tmp_path / "file")),
        ("load of an empty directory", lambda: kiln.load(tmp_path / "empty.kiln")),
        ("save onto a file", lambda: module.save(tmp_path / "file")),
        ("save under a file", lambda: module.save(tmp_path / "file" / "net.kiln")),
        ("save over someone's directory", lambda: module.save(tmp_path / "full")),
    ]:
        refused(fn, ArtifactError, what=what)
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("target,cls", [
    ("interpret", ArtifactError), ("tpu", TargetError), (5, TargetError),
    ("cuda", TargetError if NO_GPU else ArtifactError),  # no GPU / not what it was for
])
def test_wrong_targets(saved, target, cls):
    refused(lambda: kiln.load(saved[0], target=target), cls)


def _write(path, name, data: bytes):
    (path / name).write_bytes(data)


def _truncate(path, name, keep: int):
    data = (path / name).read_bytes()
    (path / name).write_bytes(data[:keep])


BROKEN_FILES = [
    ("manifest garbage", lambda p: _write(p, "manifest.json", b"\x00\xff garbage")),
    ("manifest truncated", lambda p: _truncate(p, "manifest.json", 200)),
    ("manifest empty", lambda p: _write(p, "manifest.json", b"")),
    ("manifest a list", lambda p: _write(p, "manifest.json", b"[1, 2]")),
    ("manifest a directory", lambda p: ((p / "manifest.json").unlink(),
                                        (p / "manifest.json").mkdir())),
    ("weights missing", lambda p: (p / "weights.safetensors").unlink()),
    ("weights garbage", lambda p: _write(p, "weights.safetensors", b"garbage" * 10)),
    ("weights truncated", lambda p: _truncate(p, "weights.safetensors", 20)),
    ("weights truncated in the data", lambda p: _truncate(
        p, "weights.safetensors", (p / "weights.safetensors").stat().st_size - 8)),
    ("parallel.json a list", lambda p: _write(p, "parallel.json", b"[1]")),
    ("parallel.json garbage", lambda p: _write(p, "parallel.json", b"{")),
]


@pytest.mark.parametrize("case", BROKEN_FILES, ids=[c[0] for c in BROKEN_FILES])
def test_broken_files(copy_of, case):
    what, damage = case
    path = copy_of("net.kiln")
    damage(path)
    refused(lambda: kiln.load(path), ArtifactError, what=what)


WRONG_VALUES = [None, 7, "s", [], {}]
MANIFEST_KEYS = ["format", "format_version", "versions", "target", "example_sizes", "plan",
                 "memory", "kernels", "weights"]


def test_every_manifest_entry_dropped_or_of_the_wrong_type(copy_of, saved):
    """Each damaged manifest is refused, or (an entry kiln can do without, like the
    versions) still loads a module that matches eager."""
    _, model = saved
    manifest = json.loads((saved[0] / "manifest.json").read_text())
    assert sorted(manifest) == sorted(MANIFEST_KEYS), "a new manifest entry: add it here"
    x = torch.randn(3, 3)
    for key in MANIFEST_KEYS:
        for value in ["<dropped>", *WRONG_VALUES]:
            path = copy_of(f"{key}-{value!r}")
            damaged = dict(manifest)
            if value == "<dropped>":
                del damaged[key]
            else:
                damaged[key] = value
            (path / "manifest.json").write_text(json.dumps(damaged))
            loaded = kiln_error_or(lambda path=path: kiln.load(path))
            if loaded is not None:
                call_and_compare(loaded, model, (x,))


def test_the_loaded_module_refuses_wrong_calls(saved):
    loaded = kiln.load(saved[0])
    x = torch.randn(3, 3)
    for what, args, cls in [("no argument", (), ArgumentError),
                            ("two arguments", (x, x), ArgumentError),
                            ("float64", (x.double(),), DTypeError),
                            ("past the Dim's max", (torch.randn(9, 3),), ShapeError),
                            ("a size-0 batch", (torch.randn(0, 3),), ShapeError),
                            ("a str", ("x",), ArgumentError)]:
        refused(lambda args=args: loaded(*args), cls, what=what)
