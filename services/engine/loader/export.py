"""Write a loaded model as a Hugging Face directory (LlamaForCausalLM), its weights in their dtype.

The result loads in transformers and vLLM (e.g. to compare against a peer on the same weights)
and through ``load_model`` again; the weight cache stores GGUF loads in this same layout.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from crescent.services.engine.device import dtype_name
from crescent.services.engine.loader.loaded import LoadedModel

WEIGHTS_FILE = "model.safetensors"


def export_hf_dir(loaded: LoadedModel, out_dir: Path) -> None:
    """Write config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = loaded.config
    hf_config = config.to_hf_dict()
    hf_config["torch_dtype"] = dtype_name(loaded.weights["model.embed_tokens.weight"].dtype)  # as written below
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tensors = {name: t.contiguous() for name, t in sorted(loaded.weights.items())}
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt", "model_id": loaded.model_id})
    loaded.tokenizer.save_hf(out_dir, model_max_length=config.max_position_embeddings)
