#!/usr/bin/env bash
# The README's first setup command, run in a fresh virtual environment, installs no CUDA package:
# fails (exit 1) naming any nvidia-* or triton distribution it brought in.
# Usage: bash tests/install_check.sh [VENV_DIR]   (default: a temporary folder, removed afterwards)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-}"
if [ -z "$venv" ]; then
    venv="$(mktemp -d)/venv"
    trap 'rm -rf "$(dirname "$venv")"' EXIT
fi
# The first indented line of the README's "Setup and first run" section is the command a reader runs first.
command="$(awk '/^## Setup and first run/{s=1; next} /^## /{s=0} s && /^    [^ ]/{sub(/^    /, ""); print; exit}' "$repo/README.md")"
case "$command" in
    pip\ install*) ;;
    *) echo "install_check: the README's first setup command is not a pip install: '$command'" >&2; exit 2 ;;
esac
python3 -m venv "$venv"
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
# The install works: the README's next commands, into folders beside the venv; the 4-bit schemes pass the
# default verify as well.
model="$("$venv/bin/qconvert" example-model)"
for scheme in int8 int4 nf4; do
    out="$(dirname "$venv")/minilm-$scheme"
    rm -rf "$out"
    "$venv/bin/qconvert" quantize "$model" -o "$out" --scheme "$scheme" -q
    "$venv/bin/qconvert" inspect "$out" > /dev/null
    if [ "$scheme" != int8 ]; then "$venv/bin/qconvert" verify "$out" -q; fi
    rm -rf "$out"
done
echo "install_check: no nvidia-* or triton package; qconvert quantize, inspect and verify work"
