import os

import pytest
import torch

from tests.models.support import FAMILIES, make_checkpoint

os.environ.setdefault("KILN_PROGRESS", "0")


def pytest_collection_modifyitems(config, items):
    # Minutes-long tests (e.g. compiling every tuning config) run only when asked for.
    if os.environ.get("KILN_RUN_SLOW") != "1":
        slow = pytest.mark.skip(reason="slow: set KILN_RUN_SLOW=1 to run it")
        for item in items:
            if item.get_closest_marker("slow") is not None:
                item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def _gpu_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kiln-gpu-cache")


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """Module- and session-scoped fixtures compile before the per-test fixture below
    sets a test's cache: they get a cache of this session's own, never the user's
    KILN_CACHE_DIR, so a warm machine runs them as a clean one does (a compiled module
    kept by an earlier run had no decomposition to time: test_explain's phases)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("KILN_CACHE_DIR", str(tmp_path_factory.mktemp("kiln-session-cache")))
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _isolated_cache(request, tmp_path, monkeypatch, _gpu_cache):
    # CPU tests each get a fresh cache (quarantine and tuning results never leak between
    # them); GPU tests share one, so a kernel met in many tests is tuned once.
    gpu = request.node.get_closest_marker("gpu") is not None
    monkeypatch.setenv("KILN_CACHE_DIR", str(_gpu_cache if gpu else tmp_path / "kiln-cache"))
    if request.node.get_closest_marker("compile_cache") is None:
        # tests patch kiln's own code (a template, the pass list) between compiles of one
        # model, which no compile-cache key sees: only the cache's own tests use it
        monkeypatch.setenv("KILN_COMPILE_CACHE", "0")


# Tiny HF checkpoints and the kiln LLMs compiled from them: shared by tests/models and
# tests/parallel (compiling is the slow part, so once per session).
@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> (checkpoint dir, the transformers model saved there)."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    return {f: (root / f, make_checkpoint(root / f, f)) for f in FAMILIES}


@pytest.fixture(scope="session")
def llms(checkpoints):
    """family -> a kiln LLM (contiguous cache, batches of up to 3), compiled on first use."""
    import kiln.models

    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = kiln.models.load(checkpoints[family][0], max_batch_size=3,
                                             dtype=torch.float32)
        return cache[family]

    return get
