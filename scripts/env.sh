# Sourced by the other scripts: a project-local virtualenv with ckpt-ferry installed.
# Usage: source scripts/env.sh [EXTRAS]   (EXTRAS like "test" or "test,bench")
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
extras="${1:-}"
pip install --quiet --disable-pip-version-check -e ".${extras:+[$extras]}"
