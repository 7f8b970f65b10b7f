#!/usr/bin/env bash
# Fresh machine → npumoe with its test extras and system packages → the whole test suite.
source "$(dirname "$0")/lib.sh"
ensure_torch
ensure_apt_packages
"$PY" -m pip install --quiet -e ".[test]"
"$PY" -m pytest -q --durations=15 "$@"  # the slowest tests listed: the suite is kept under 15 min
