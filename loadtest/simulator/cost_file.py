"""Reading a ``cost:`` file (``crescent profile --out``, or a scheduler settings file) for the simulators."""

from __future__ import annotations

from pathlib import Path

import yaml

from crescent.services.scheduler.config import CostSettings
from crescent.services.scheduler.cost_model import CostModels
from crescent.services.scheduler.cost_presets import cost_models_from_settings


class CostFileError(ValueError):
    """A cost file the simulators cannot use; the message says what to change."""


def load_cost_file(path: Path) -> CostModels:
    """The cost models of the file's ``cost:`` section (unknown keys and negative values refused)."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CostFileError(f"{path}: cannot read the cost file: {exc}") from None
    if not isinstance(doc, dict) or "cost" not in doc:
        raise CostFileError(f"{path}: no 'cost:' section; write one with `crescent profile --out {path}`")
    try:
        return cost_models_from_settings(CostSettings.model_validate(doc["cost"]))
    except ValueError as exc:
        raise CostFileError(f"{path}: invalid cost section: {exc}") from None
