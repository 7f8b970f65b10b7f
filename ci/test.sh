#!/usr/bin/env bash
# Fresh machine → npumoe with its test extras and system packages → the whole test suite.
source "$(dirname "$0")/lib.sh"
ensure_torch
ensure_apt_packages
"$PY" -m pip install --quiet -e ".[test]"
# one worker per core (at most 4), each test file whole on one worker (its module fixtures built once), handed out
# in collection order (tests/conftest.py puts the longest files first); the slowest tests listed: the suite is kept
# under 15 min on 2 cores
"$PY" -m pytest -q -n auto --maxprocesses 4 --dist loadfile --durations=30 --no-loadscope-reorder "$@"
