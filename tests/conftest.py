import sys
import types

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A complete synthetic HF checkpoint directory of the `tiny` preset (bf16, seed 0)."""
    from replicas.checkpoint import make_checkpoint

    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=0, dtype="bf16")


@pytest.fixture
def fake_cupy(monkeypatch):
    """fake_cupy(n): `import cupy` succeeds and its runtime reports n GPUs (an exception: raised), so
    engine choice and the no-GPU error path run on a CPU machine."""
    from importlib.machinery import ModuleSpec

    def install(device_count=1):
        def count():
            if isinstance(device_count, Exception):
                raise device_count
            return device_count

        cupy = types.ModuleType("cupy")
        cupy.__spec__ = ModuleSpec("cupy", None)  # importlib.util.find_spec("cupy") answers
        cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=count))
        monkeypatch.setitem(sys.modules, "cupy", cupy)

    return install


@pytest.fixture
def monokernel_builds(monkeypatch, fake_cupy):
    """[(factory class name, keywords)] of each monokernel engine built; a paced stand-in engine with
    the asked-for slots (and the checkpoint's shape, where `path` is one) is returned instead."""
    from pathlib import Path

    from replicas.monokernel import MonokernelEngine
    from replicas.monokernel_batched import BatchedMonokernelEngine
    from replicas.testing import PacedEngine

    calls = []

    def record(cls, path, **kw):
        calls.append((cls.__name__, kw))
        paced = dict(tokens_per_s=100_000, max_batch=kw.get("batch", 1))
        return PacedEngine.from_pretrained(path, **paced) if (Path(path) / "config.json").is_file() \
            else PacedEngine(**paced)

    for cls in (MonokernelEngine, BatchedMonokernelEngine):
        monkeypatch.setattr(cls, "from_pretrained", classmethod(record))
    fake_cupy(1)
    return calls


# `make test` runs the suite on two pytest-xdist workers (CI has two cores). Tests that start a local Ray cluster
# all go to one worker, one after another: two Ray clusters starting at once on two cores time out.
# The marker must be on the items before xdist's own collection hook turns it into the `@ray` node-id suffix its
# scheduler groups by; xdist's worker plugin registers after this conftest, so it would run first without tryfirst
# (it did, and the Ray tests ran on both workers at once).
RAY_MODULES = ("test_ray_", "test_cluster_cli")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rpartition(".")[2].startswith(RAY_MODULES):
            item.add_marker(pytest.mark.xdist_group("ray"))
