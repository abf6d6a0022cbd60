# Sourced by the other scripts: a project-local virtualenv with ckpt-ferry installed.
# Usage: source scripts/env.sh [EXTRAS]   (EXTRAS like "test" or "test,bench")
# Sourced from an interactive shell (the README's `source scripts/env.sh test`), it leaves
# the shell's options and directory as they were: under `set -e` the shell's next failing
# command would close it.
if [[ $- == *i* ]]; then
  _ferry_dir=$PWD
  cd "$(dirname "${BASH_SOURCE[0]}")/.." || return 1
else
  set -euo pipefail
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
fi
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
  # a failed install stops the script that sourced this (under `set -e` a failure left of
  # `&&` would not), and from a shell it returns 1, the install not stamped
  if ! pip install --quiet --disable-pip-version-check -e ".${extras:+[$extras]}"; then
    echo "scripts/env.sh: the install failed" >&2
    if [ -n "${_ferry_dir:-}" ]; then cd "$_ferry_dir" || true; unset _ferry_dir; fi
    return 1 2>/dev/null || exit 1
  fi
  echo "$want" > "$stamp"
fi
if [ -n "${_ferry_dir:-}" ]; then
  cd "$_ferry_dir" || true
  unset _ferry_dir
fi
