"""Regenerate the Python stubs of the monoserve gRPC API from proto/monoserve/v1/*.proto.

    python proto/regen.py            # rewrite the committed stubs beside the .proto files
    python proto/regen.py --out DIR  # write them under DIR instead (the freshness test does this)

Needs grpcio-tools (the `test`/`dev` extras). The stubs import each other as `monoserve.v1.*`,
so the package root `proto/` must be on sys.path (pyproject's package list does that when
installed; tests add it via pytest's `pythonpath`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "monoserve" / "v1"


def proto_files() -> list[Path]:
    return sorted(PACKAGE_DIR.glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Run protoc on every .proto; returns the generated files (under out_root/monoserve/v1)."""
    import grpc_tools
    from grpc_tools import protoc

    out_root.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    rel = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *rel,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    out_dir = out_root / "monoserve" / "v1"
    return sorted(p for p in out_dir.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="package root to write into")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
