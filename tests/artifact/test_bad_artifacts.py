"""Bad artifacts: each an ArtifactError naming the file and what to do; nothing half-loaded."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import kiln
import kiln.artifact.weights as weights_mod
from kiln.errors import ArtifactError, TargetError


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x):
        return torch.relu(self.lin(x)).sum(-1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "net.kiln"
    kiln.compile(Net(), (torch.randn(3, 8),)).save(path)
    return path


@pytest.fixture
def art(saved, tmp_path):
    """A fresh copy of a good artifact, to break."""
    dst = tmp_path / "net.kiln"
    shutil.copytree(saved, dst)
    return dst


@pytest.fixture
def reads(monkeypatch):
    """Counts tensors read from the weights file."""
    calls = []
    real = weights_mod._own_copy
    monkeypatch.setattr(weights_mod, "_own_copy", lambda t, d: calls.append(1) or real(t, d))
    return calls


def _edit_manifest(path, fn):
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    (path / "manifest.json").write_text(json.dumps(m))


def _net_from_weights(art, x):
    """Net's output computed eagerly from the weights the artifact holds."""
    w = load_file(art / "weights.safetensors")
    return torch.relu(x @ w["lin.weight"].T + w["lin.bias"]).sum(-1)


def test_good_artifact_loads(art):
    x = torch.randn(3, 8)
    torch.testing.assert_close(kiln.load(art)(x), _net_from_weights(art, x))


def test_missing_directory(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist") as e:
        kiln.load(tmp_path / "nope.kiln")
    assert "nope.kiln" in str(e.value) and "kiln compile" in e.value.hint


def test_path_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ArtifactError, match="is a file"):
        kiln.load(tmp_path / "f")


def test_missing_manifest(art):
    (art / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match="has no manifest.json"):
        kiln.load(art)


def test_corrupt_manifest(art):
    text = (art / "manifest.json").read_text()
    (art / "manifest.json").write_text(text[: len(text) // 2])
    with pytest.raises(ArtifactError, match=r"cannot read .*manifest\.json") as e:
        kiln.load(art)
    assert "recompile" in e.value.hint


def test_foreign_json(art):
    (art / "manifest.json").write_text('{"hello": 1}')
    with pytest.raises(ArtifactError, match="not a kiln artifact manifest"):
        kiln.load(art)


def test_wrong_format_version(art):
    _edit_manifest(art, lambda m: m.update(format_version=99))
    with pytest.raises(ArtifactError, match="format version 99.*reads version 1") as e:
        kiln.load(art)
    assert "kiln compile" in e.value.hint


def test_missing_manifest_entry(art):
    _edit_manifest(art, lambda m: m.pop("memory"))
    with pytest.raises(ArtifactError, match=r"manifest\.json is not a valid.*'memory'"):
        kiln.load(art)


def test_plan_that_does_not_verify(art):
    def break_plan(m):
        m["plan"]["regions"][0]["inputs"].append("ghost")

    _edit_manifest(art, break_plan)
    with pytest.raises(ArtifactError, match="does not verify"):
        kiln.load(art)


def test_unknown_kernel_kind(art):
    _edit_manifest(art, lambda m: m["kernels"]["r0"].update(kind="quantum"))
    with pytest.raises(ArtifactError, match="unknown kind 'quantum'"):
        kiln.load(art)


def test_missing_weights_file(art, reads):
    (art / "weights.safetensors").unlink()
    with pytest.raises(ArtifactError, match=r"no weights file .*weights\.safetensors"):
        kiln.load(art)
    assert reads == []


def test_truncated_weights_file(art, reads):
    data = (art / "weights.safetensors").read_bytes()
    (art / "weights.safetensors").write_bytes(data[: len(data) - 20])
    match = r"cannot read the weights file .*weights\.safetensors"
    with pytest.raises(ArtifactError, match=match) as e:
        kiln.load(art)
    assert "truncated or corrupt" in e.value.hint
    assert reads == []


def test_tensor_shape_mismatch_is_caught_before_reading(art, reads):
    tensors = load_file(art / "weights.safetensors")
    tensors["lin.weight"] = torch.randn(4, 9)
    save_file(tensors, art / "weights.safetensors")
    with pytest.raises(ArtifactError, match=r"'lin\.weight' in .*weights\.safetensors is "
                                            r"float32\[4, 9\].*float32\[4, 8\]"):
        kiln.load(art)
    assert reads == []  # rejected from the header: no tensor was loaded


def test_tensor_missing_from_file(art, reads):
    tensors = load_file(art / "weights.safetensors")
    del tensors["lin.bias"]
    save_file(tensors, art / "weights.safetensors")
    with pytest.raises(ArtifactError, match=r"'lin\.bias' is missing from .*weights"):
        kiln.load(art)
    assert reads == []


def test_manifest_weights_disagree_with_plan(art):
    _edit_manifest(art, lambda m: m["weights"]["tensors"]["lin.weight"].update(shape=[4, 9]))
    with pytest.raises(ArtifactError, match=r"'lin\.weight' is listed as float32\[4, 9\]"):
        kiln.load(art)


def test_other_target_is_refused(art):
    with pytest.raises(ArtifactError, match="compiled for cpu, not interpret") as e:
        kiln.load(art, target="interpret")
    assert "--target interpret" in e.value.hint
    x = torch.randn(3, 8)  # the same artifact loads for its own target
    torch.testing.assert_close(kiln.load(art, target="cpu")(x), _net_from_weights(art, x))


@pytest.mark.parametrize("path", [None, 3, ""])
def test_path_that_is_not_a_path(saved, path):
    with pytest.raises(ArtifactError, match="named by a directory path"):
        kiln.load(path)
    with pytest.raises(ArtifactError, match="named by a directory path"):
        kiln.load(saved).save(path)


def test_save_where_a_file_is_in_the_way(saved, tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ArtifactError, match="cannot save to .*a file is in the way") as e:
        kiln.load(saved).save(tmp_path / "f" / "net.kiln")
    assert str(tmp_path / "f") in e.value.where
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # nothing left behind


def test_bad_requested_target_is_the_callers_error_not_the_manifests(saved):
    with pytest.raises(TargetError, match="named by a string, got int 5"):
        kiln.load(saved, target=5)


def test_foreign_parallel_manifest(art):
    (art / "parallel.json").write_text("[1, 2]")
    with pytest.raises(ArtifactError, match="not a valid kiln multi-device manifest"):
        kiln.load(art)


def test_cuda_graphs_of_a_cpu_module(saved):
    with pytest.raises(TargetError, match="CUDA graphs need a module compiled for a CUDA "
                       "target, not cpu"):
        kiln.load(saved).cuda_graphs()
