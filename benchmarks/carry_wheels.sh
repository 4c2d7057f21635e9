#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.sh needs on the device machine, into .whl/ (ignored by git) for
# the device tool's `carry`. That machine has Python 3.12, torch, numpy and PyYAML but no pydantic
# and no package registry (/work/.library/device/README.md). Versions are this environment's own
# (the ones CI pins), fetched with pip's ordinary client for CPython 3.12 on manylinux x86-64 (pip
# serves them from its cache when it has them). Nothing is installed here.
#
#   benchmarks/carry_wheels.sh        # then: run(carry=[".whl"], command="benchmarks/gpu_check.sh")
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
# pydantic, its compiled core and the small packages they import; typing_extensions too, as the
# image's may be older than pydantic needs (one copy only: two stop the install there)
pins=$("$python" - <<'EOF'
from importlib.metadata import version
names = ["pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions"]
print(" ".join(f"{n}=={version(n)}" for n in names))
EOF
)
rm -rf .whl && mkdir .whl
# shellcheck disable=SC2086
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $pins
ls -l .whl
du -sh .whl
