#!/usr/bin/env bash
# `make gpu-bundle`: the wheels the borrowed GPU host lacks (.ci/gpu-bundle.txt), for its Python 3.12, in one
# ignored folder that travels with the tree (the device tool's `carry`).  Needs a package index, not the CPU
# venv: the system python3 downloads and builds.  Idempotent: a stamp of the list's hash makes a rerun a no-op.
#   bash .ci/gpu-bundle.sh [OUT]     (default .cache/gpu-bundle; under 30 MiB)
# GPU_BUNDLE_PYTHON (default 3.12, the host's) picks the wheels' Python; the suite builds a 3.11 one to install.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.cache/gpu-bundle}
PY=${PYTHON:-python3}
LIST=.ci/gpu-bundle.txt
TARGET_PY=${GPU_BUNDLE_PYTHON:-3.12}
abi=cp${TARGET_PY/./}
want=$( (cat "$LIST" .ci/gpu-bundle.sh; echo "$TARGET_PY") | sha256sum | cut -d' ' -f1)
if [ -f "$OUT/.stamp" ] && [ "$(cat "$OUT/.stamp")" = "$want" ]; then
    echo "gpu-bundle: $OUT is up to date ($(du -sh "$OUT" | cut -f1))"
    exit 0
fi
binary=$(grep -v '^\s*#' "$LIST" | grep -v '^source:' | grep -v '^\s*$' | tr '\n' ' ')
source=$(grep '^source:' "$LIST" | sed 's/^source:\s*//' | tr '\n' ' ')
tmp="$OUT.tmp"
rm -rf "$tmp" && mkdir -p "$tmp"
pip=("$PY" -m pip --disable-pip-version-check)
echo "gpu-bundle: downloading $binary($abi, manylinux x86_64)"
"${pip[@]}" download -q --only-binary=:all: --python-version "$TARGET_PY" --implementation cp --abi "$abi" --abi abi3 \
    --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$tmp" $binary
echo "gpu-bundle: building $source(source archives only)"
"${pip[@]}" wheel -q --no-deps --no-binary :all: -w "$tmp" $source
for w in "$tmp"/*; do
    case "$w" in *.whl) ;; *) echo "gpu-bundle: $w is not a wheel" >&2; exit 1 ;; esac
done
# one version of each package
dupes=$(ls "$tmp" | sed 's/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
[ -z "$dupes" ] || { echo "gpu-bundle: several versions of: $dupes" >&2; exit 1; }
size=$(du -sm "$tmp" | cut -f1)
[ "$size" -lt 30 ] || { echo "gpu-bundle: $size MiB, over the 30 MiB the device tool carries for it" >&2; exit 1; }
echo "$want" > "$tmp/.stamp"
rm -rf "$OUT" && mv "$tmp" "$OUT"
echo "gpu-bundle: $(ls "$OUT" | wc -l) wheels, $(du -sh "$OUT" | cut -f1) in $OUT:"
ls "$OUT" | sed 's/^/  /'
