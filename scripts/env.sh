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
# Install only when what the install depends on changed (it takes ~15 s, the C extension
# included): one stamp per extras holds a digest of pyproject.toml and the extension source.
stamp=".venv/.ferry-install-stamp${extras:+-$extras}"
want="$(cat pyproject.toml transfer/codec/_planes.c | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  pip install --quiet --disable-pip-version-check -e ".${extras:+[$extras]}"
  echo "$want" > "$stamp"
fi
