# Shared set-up for the ci/ scripts: sourced, not run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}

# torch first, pinned: with no torch installed, any looser request pulls a multi-GB CUDA build.
ensure_torch() {
    if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
        "$PY" -m pip install --quiet torch==2.13.0
    fi
}

# System packages the tests use (cross compilers, emulators), listed one per line in ci/apt-packages.txt.
ensure_apt_packages() {
    local missing=()
    while read -r pkg; do
        [[ -z "$pkg" || "$pkg" == \#* ]] && continue
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done < ci/apt-packages.txt
    if ((${#missing[@]})); then
        if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
        else
            echo "note: not installing ${missing[*]} (needs root + apt); the tests that need them will skip" >&2
        fi
    fi
}
