#!/usr/bin/env bash
# The GPU self-check as one command on a machine that reaches no package registry: run from the
# repository root of a source tree (nothing installed), with the wheels the machine's image lacks
# carried in bench/gpu_wheels/ (`make gpu-wheels` fills it; docs/benchmarks.md, "GPU").
#
#   bash bench/gpu_run.sh OUT [--smoke] [--sections ...] [--deadline S] [--budget SECTION=S]
#
# Installs the wheels into a temporary folder put first on PYTHONPATH, prints the card, then runs
# bench/gpu_run.py (the environment, every section in its own process under its time limit):
# OUT/gpu_selfcheck.json, OUT/gpu_selfcheck.md and this output in OUT/gpu_run.log. Exit status:
# gpu_run.py's (0 every section ran, 1 a section failed, 3 the environment is not ready), or 3
# when the wheels are missing or do not install. GPU_WHEELS=none runs on an environment that
# already has them (the project's own virtualenv); PYTHON picks the interpreter (default python3).
set -uo pipefail

if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
    echo "usage: bash bench/gpu_run.sh OUT [--smoke] [gpu_run.py options]" >&2
    exit 2
fi
out=$1
shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
wheels=${GPU_WHEELS:-$root/bench/gpu_wheels}

install_wheels() {
    # The wheel of each name bench/gpu_wheels.txt pins, and only those: another version lying in
    # the folder would stop pip ("two versions") or shadow the pinned one.
    local name version found files=() missing=0
    while read -r name version; do
        found=$(compgen -G "$wheels/${name//-/_}-$version-*.whl" | head -n 1)
        if [ -z "$found" ]; then
            echo "gpu_run: no wheel of $name $version in $wheels" >&2
            missing=1
        fi
        files+=("$found")
    done < <(sed -n 's/^\([A-Za-z0-9_.-]*\)==\([^ ]*\).*/\1 \2/p' "$root/bench/gpu_wheels.txt")
    if [ "$missing" -ne 0 ]; then
        echo "gpu_run: run 'make gpu-wheels' where pip reaches a registry, and carry bench/gpu_wheels" >&2
        return 3
    fi
    echo "wheels: ${#files[@]}, $(du -ch "${files[@]}" | tail -n 1 | cut -f1), from $wheels"
    "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
        --disable-pip-version-check --target "$site" "${files[@]}" || return 3
}

main() {
    echo "gpu_run: $(date -u +%Y-%m-%dT%H:%M:%SZ) in $root"
    if [ "$wheels" != none ]; then
        install_wheels || return 3
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
    else
        echo "nvidia-smi: not found"
    fi
    PYTHONUNBUFFERED=1 "$python" "$root/bench/gpu_run.py" "$out" "$@"
}

mkdir -p "$out"
site=$(mktemp -d "${TMPDIR:-/tmp}/longstraw-wheels.XXXXXX")
trap 'rm -rf "$site"' EXIT
main "$@" 2>&1 | tee "$out/gpu_run.log"
exit "${PIPESTATUS[0]}"
