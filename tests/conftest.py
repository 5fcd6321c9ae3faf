import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A complete synthetic HF checkpoint directory of the `tiny` preset (bf16, seed 0)."""
    from replicas.checkpoint import make_checkpoint

    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=0, dtype="bf16")
