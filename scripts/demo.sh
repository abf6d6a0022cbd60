#!/usr/bin/env bash
# Installs ckpt-ferry into .venv and runs the demo: three checkpoints pushed to a local
# store with dedupe, the latest pulled back and verified. Extra args go to `ferry demo`.
source "$(dirname "$0")/env.sh"
ferry demo "$@"
