"""The gRPC API package: stubs are fresh, importable as `monoserve.v1`, and the schema keeps its rules."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "proto"))
import regen

# Lines that record the generator's version; equal when the pinned grpcio-tools is installed.
VERSION_STAMP = re.compile(rb"^(# Protobuf Python Version: .*|GRPC_GENERATED_VERSION = .*|    \d+,)$", re.MULTILINE)


def test_regenerating_stubs_changes_nothing(tmp_path):
    from importlib.metadata import version

    import grpc_tools

    fresh = regen.generate(tmp_path)
    assert fresh, "protoc produced nothing"
    exact = version("grpcio-tools") == "1.85.1"  # the version pinned in pyproject.toml
    for new in fresh:
        committed = regen.PACKAGE_DIR / new.name
        assert committed.is_file(), f"{committed.name} is not committed: run `python proto/regen.py`"
        a, b = committed.read_bytes(), new.read_bytes()
        if not exact:
            a, b = VERSION_STAMP.sub(b"", a), VERSION_STAMP.sub(b"", b)
        assert a == b, f"{committed.name} is stale: run `python proto/regen.py` and commit the result"
    committed = {p.name for p in regen.PACKAGE_DIR.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))}
    assert committed == {p.name for p in fresh}, "stubs committed without a .proto: delete them"
    assert grpc_tools


@pytest.mark.parametrize("name", ["common", "inference", "replica", "admin"])
def test_stubs_import_as_monoserve_v1(name):
    pb2 = importlib.import_module(f"monoserve.v1.{name}_pb2")
    importlib.import_module(f"monoserve.v1.{name}_pb2_grpc")
    assert pb2.DESCRIPTOR.package == "monoserve.v1"


def _all_messages_and_enums():
    for name in ("common", "inference", "replica", "admin"):
        fd = importlib.import_module(f"monoserve.v1.{name}_pb2").DESCRIPTOR
        yield from fd.message_types_by_name.values()
        yield from fd.enum_types_by_name.values()


def test_every_enum_has_an_unspecified_zero():
    for d in _all_messages_and_enums():
        if hasattr(d, "values_by_number"):
            zero = d.values_by_number[0].name
            assert zero.endswith("_UNSPECIFIED"), f"{d.full_name}: value 0 is {zero}, want *_UNSPECIFIED"


def test_every_field_message_and_rpc_is_documented():
    """Each field, message, enum value and rpc in the .proto sources has a comment above it."""
    checked = 0
    for proto in regen.proto_files():
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            if not s or s.startswith(("//", "}", "syntax", "package", "import", "oneof")):
                continue
            declaration = s.startswith(("service ", "message ", "enum ", "rpc "))
            field = re.match(r"^((optional |repeated )?[\w.]+ \w+|[A-Z][A-Z0-9_]*) = \d+;", s)  # field or enum value
            if declaration or field:
                prev = lines[i - 1].strip() if i else ""
                assert prev.startswith("//"), f"{proto.name}:{i + 1}: `{s}` has no comment above it"
                checked += 1
    assert checked > 100  # the pattern really matched the declarations


def test_one_request_and_response_message_per_rpc():
    from monoserve.v1 import admin_pb2, inference_pb2, replica_pb2

    seen: set[str] = set()
    for mod in (inference_pb2, replica_pb2, admin_pb2):
        for service in mod.DESCRIPTOR.services_by_name.values():
            for m in service.methods:
                assert m.input_type.full_name not in seen, f"{m.full_name}: request type reused"
                seen.add(m.input_type.full_name)


def test_sampling_unset_fields_are_distinguishable_from_zero():
    from monoserve.v1 import common_pb2

    s = common_pb2.SamplingParams()
    assert not s.HasField("max_tokens") and not s.HasField("top_p") and not s.HasField("seed")
    s.top_p = 0.0
    assert s.HasField("top_p"), "an explicit top_p=0 must reach validation (and be refused)"
