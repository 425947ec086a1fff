#!/usr/bin/env bash
# Fills the wheelhouse an offline GPU machine installs from (scripts/gpu_check.sh's env stage runs
# `pip install --no-index` from it): every package in scripts/gpu_wheels.txt as a Python 3.12
# manylinux x86_64 wheel (pip download; a package with no such wheel is built with pip wheel), and the
# Kimi vocabulary for the seeded kimi-k3-nano. Both folders are ignored by git (.gitignore: /.whl/,
# /.gpu-carry/) and travel with `carry: [".whl", ".gpu-carry"]`; with the tracked tree they must stay
# under the 64 MiB a run may carry, which this script checks.
#
#   bash scripts/gpu_wheelhouse.sh          on a machine with PyPI, from anywhere in the repo
# Environment: GPU_CHECK_WHEELS (default .whl), GPU_WHEELHOUSE_MAX_MIB (default 64).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

WHEELS=${GPU_CHECK_WHEELS:-.whl}
CARRY=.gpu-carry
MAX_MIB=${GPU_WHEELHOUSE_MAX_MIB:-64}
mkdir -p "$WHEELS" "$CARRY"

platforms=()
for n in 17 24 27 28 31 34 35 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
failed=0
while read -r req; do
    req=${req%%#*}; req=${req// /}
    [ -z "$req" ] && continue
    if ! python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            "${platforms[@]}" --platform manylinux2014_x86_64 -d "$WHEELS" "$req" 2>/dev/null; then
        # no binary for 3.12 manylinux: a pure-Python sdist builds into a universal wheel here
        echo "no 3.12 manylinux wheel for $req: building one with pip wheel"
        python3 -m pip wheel -q --no-deps -w "$WHEELS" "$req" || { echo "cannot get $req"; failed=1; }
    fi
done < scripts/gpu_wheels.txt

if [ -d ../shared/kimi-tokenizer ]; then cp -r ../shared/kimi-tokenizer "$CARRY/"
elif [ -d /work/shared/kimi-tokenizer ]; then cp -r /work/shared/kimi-tokenizer "$CARRY/"
else echo "no kimi-tokenizer folder beside the repo: the smoke test cannot serve kimi-k3-nano there"; fi

tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
carried=$(du -sb "$WHEELS" "$CARRY" | awk '{s += $1} END {print s}')
total_mib=$(( (tree + carried) / 1048576 ))
echo "wheelhouse: $(ls "$WHEELS"/*.whl 2>/dev/null | wc -l) wheels; $WHEELS + $CARRY = $((carried / 1048576)) MiB," \
     "tracked tree $((tree / 1048576)) MiB, together $total_mib MiB of $MAX_MIB"
if [ "$total_mib" -ge "$MAX_MIB" ]; then echo "too big to carry: drop wheels from scripts/gpu_wheels.txt"; exit 1; fi
[ $failed -eq 0 ] || exit 1
echo "carry [\"$WHEELS\", \"$CARRY\"] and run: bash scripts/gpu_check.sh"
