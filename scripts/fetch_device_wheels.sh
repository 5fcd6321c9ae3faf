#!/usr/bin/env bash
# Wheels the GPU device machine lacks (it has torch, cupy, transformers, numpy, but not pydantic),
# downloaded here into .whl/ (git-ignored) so a device call can carry them: run(..., carry=[".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl pydantic pydantic-core annotated-types typing-inspection typing-extensions
ls .whl
