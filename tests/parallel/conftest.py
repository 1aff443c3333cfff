import pytest


@pytest.fixture(scope="session")
def transformers_checkpoints(tmp_path_factory):
    """Llama, Mistral and Qwen2 checkpoints made by transformers, with its outputs
    (tests/parallel/transformers_plans.py)."""
    pytest.importorskip("transformers")
    from tests.parallel.transformers_plans import make_references

    return make_references(tmp_path_factory.mktemp("plans"))
