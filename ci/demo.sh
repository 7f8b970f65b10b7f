#!/usr/bin/env bash
# Fresh machine → npumoe installed → the main job on the embedded demo model.
source "$(dirname "$0")/lib.sh"
ensure_torch
"$PY" -m pip install --quiet -e ".[demo]"  # the demo builds for the HTP and the ANE
npumoe demo "$@"
