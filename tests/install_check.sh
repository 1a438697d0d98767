#!/usr/bin/env bash
# The README's install command, run in a fresh virtual environment, installs no CUDA package: fails (exit 1) naming
# any nvidia-* or triton distribution it brought in. Then the README's first commands work there.
# Usage: bash tests/install_check.sh [VENV_DIR]
# Everything is written into a fresh temporary folder, which is removed at the end, and nothing else is removed.
# With VENV_DIR (a path that does not exist yet) the virtual environment is made there instead, and kept.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
venv="${1:-$work/venv}"
if [ -e "$venv" ]; then
    echo "install_check: $venv exists; give a VENV_DIR that does not (nothing of it is replaced)" >&2
    exit 2
fi
# The README's "Setup and first run" section: its first indented line that is a pip install.
command="$(awk '/^## Setup and first run/{s=1; next} /^## /{s=0} s && /^    pip install /{sub(/^    /, ""); print; exit}' \
    "$repo/README.md")"
if [ -z "$command" ]; then
    echo "install_check: the README's \"Setup and first run\" section has no pip install line" >&2
    exit 2
fi
python3 -m venv "$venv"
venv="$(cd "$venv" && pwd)"  # the install runs from the repository
echo "install_check: running in a fresh venv: $command"
(cd "$repo" && . "$venv/bin/activate" && eval "$command")
"$venv/bin/python" -m pip list --format=freeze > "$venv/installed.txt"
cuda="$(grep -i -E '^(nvidia-[^=]*|triton)==' "$venv/installed.txt" || true)"
echo "install_check: $(wc -l < "$venv/installed.txt") packages, $(du -sm "$venv" | cut -f1) MB"
if [ -n "$cuda" ]; then
    echo "install_check: CUDA packages installed:" >&2
    echo "$cuda" >&2
    exit 1
fi
# The install works: the README's next commands, in the temporary folder; the 4-bit schemes pass the default
# verify as well.
cd "$work"
model="$("$venv/bin/qconvert" example-model)"
for scheme in int8 int4 nf4; do
    out="$work/minilm-$scheme"
    "$venv/bin/qconvert" quantize "$model" -o "$out" --scheme "$scheme" -q
    "$venv/bin/qconvert" inspect "$out" > /dev/null
    if [ "$scheme" != int8 ]; then "$venv/bin/qconvert" verify "$out" -q; fi
done
echo "install_check: no nvidia-* or triton package; qconvert quantize, inspect and verify work"
