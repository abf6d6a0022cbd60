#!/usr/bin/env bash
# Installs ckpt-ferry into .venv (once) and runs the demo: two agents on loopback; node-a's
# pushes a small training run's saves in the background, then a scheduler asks node-b for an
# estimate and prefetches the latest save there, checked byte for byte; a second round onto a
# node holding the previous save. Extra args go to `ferry demo`.
source "$(dirname "$0")/env.sh" ""  # (no extras; not the demo's own args)
ferry demo "$@"
