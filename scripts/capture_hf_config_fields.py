"""Capture the generic fields transformers writes into every config.json, for the test fixtures.

    pip install --target /tmp/tf4 transformers==4.57.1    # and /tmp/tf5 transformers==5.25.0
    PYTHONPATH=/tmp/tf4 python scripts/capture_hf_config_fields.py tests/fixtures/hf_config

writes ``transformers-<version>.json``: ``PretrainedConfig().to_dict()`` (every generic field with
its default, as ``save_pretrained`` writes it into a nested ``text_config``/``vision_config``).
The tests build real-format configs from these files (``tests/engine/hf_written.py``), and
``services/model/hf_config.GENERIC_FIELDS`` must name every key in them. transformers is not a
dependency of Crescent: run this by hand when a new transformers release is to be covered.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out_dir: str) -> None:
    import transformers
    from transformers import PretrainedConfig

    generic = json.loads(PretrainedConfig().to_json_string(use_diff=False))
    path = Path(out_dir) / f"transformers-{transformers.__version__}.json"
    path.write_text(json.dumps(generic, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{path}: {len(generic)} generic fields")


if __name__ == "__main__":
    main(sys.argv[1])
