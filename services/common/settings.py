"""Typed settings for every service: a YAML file plus prefixed environment variables.

Each service declares one pydantic model (``extra="forbid"``: a misspelt key is an error, not a
silent default). ``load_settings`` reads the YAML file, overlays environment variables named
``CRESCENT_<SERVICE>__<FIELD>[__<SUBFIELD>...]`` (values parsed as YAML scalars), validates,
and raises ``SettingsError`` whose message names every setting to change.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

S = TypeVar("S", bound=BaseModel)


class SettingsError(ValueError):
    """Settings that cannot be used; the message names the offending keys."""


class StrictModel(BaseModel):
    """Base of every settings model: unknown keys are errors and values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ListenSettings(StrictModel):
    """Where a service listens. Port 0 asks the OS for a free port."""

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    admin_port: int = Field(default=0, ge=0, le=65535, description="HTTP /health and /metrics")
    admin_host: str | None = Field(
        default=None, description="address of the /health and /metrics port; unset: the same as host "
                                  "(crescent up keeps it on 127.0.0.1 whatever --host says)")


def _env_overrides(prefix: str, environ: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    marker = prefix.upper() + "__"
    for name, raw in environ.items():
        if not name.startswith(marker):
            continue
        path = [part.lower() for part in name[len(marker) :].split("__") if part]
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = yaml.safe_load(raw) if raw != "" else ""
    return tree


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_settings(
    model: type[S],
    path: str | Path | None = None,
    *,
    env_prefix: str,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> S:
    """Build ``model`` from ``path`` (YAML, optional), then env vars, then ``overrides``."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except FileNotFoundError:
            raise SettingsError(f"config file {path} does not exist") from None
        except yaml.YAMLError as exc:
            raise SettingsError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise SettingsError(f"config file {path} must hold a mapping at the top level")
        data = loaded
    data = _merge(data, _env_overrides(env_prefix, os.environ if environ is None else environ))
    if overrides:
        data = _merge(data, overrides)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"]) or "(top level)"
            env_name = f"{env_prefix.upper()}__" + "__".join(str(p).upper() for p in err["loc"])
            problems.append(f"  {key} (env {env_name}): {err['msg']}")
        source = f" in {path}" if path else ""
        raise SettingsError(f"invalid {model.__name__} settings{source}:\n" + "\n".join(problems)) from None


def dump_settings(settings: BaseModel, path: str | Path) -> None:
    """Write settings as YAML that ``load_settings`` reads back unchanged."""
    Path(path).write_text(yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False))
