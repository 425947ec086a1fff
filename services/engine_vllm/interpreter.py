"""Which Python runs a vLLM-backed engine process.

vLLM's CPU build pins versions Crescent's main venv cannot take, so it lives in a venv of its own
(``.venv-vllm`` at the repository root, made by ``make install-vllm``/``scripts/install_vllm.sh``),
with Crescent installed into it too. The launcher (``crescent up --engine vllm``) starts engine
processes with that venv's interpreter and every other service with its own.

Imports neither vLLM nor torch: the launcher runs where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ENV_VAR = "CRESCENT_VLLM_PYTHON"
VENV_DIR = ".venv-vllm"


class VllmNotInstalledError(RuntimeError):
    """No interpreter with vLLM was found."""


def repo_root() -> Path:
    """The checkout this file lives in (services/engine_vllm/interpreter.py: two folders up), which
    is where ``.venv-vllm`` is made; meaningful for an editable install, as ``make`` does."""
    return Path(__file__).resolve().parents[2]


def vllm_python() -> str:
    """The interpreter for vLLM-backed engines: ``$CRESCENT_VLLM_PYTHON`` if set; else the
    repository's ``.venv-vllm/bin/python`` if it exists; else this interpreter if it can import
    vLLM (an image or venv with vLLM installed beside Crescent); else an error saying how to
    install it."""
    configured = os.environ.get(ENV_VAR)
    if configured:
        return configured
    venv_python = repo_root() / VENV_DIR / "bin" / "python"
    if venv_python.exists():
        return str(venv_python)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise VllmNotInstalledError(
        f"the vLLM engine backend needs vLLM, which is not installed: run `make install-vllm` "
        f"(or scripts/install_vllm.sh {repo_root() / VENV_DIR}), or set {ENV_VAR} to a Python "
        "that has both vLLM and Crescent"
    )
