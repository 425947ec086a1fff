"""Test entry: the real gateway process, serving with the fake tokenizer instead of a model.

``python -m tests.gateway.run_gateway CONFIG`` — the same ``server.main`` the CLI calls, with
the ``model_loader`` hook pointed at ``fake_tokenizer.fake_served_model``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from crescent.services.gateway.server import main

from .fake_tokenizer import fake_served_model

if __name__ == "__main__":
    main(Path(sys.argv[1]), model_loader=fake_served_model)
