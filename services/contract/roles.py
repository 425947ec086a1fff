"""Which settings each role reads: role -> (module, settings class), named, never imported here.

A tensor-parallel worker reads its role's settings (``engine/parallel/worker.py``), ``crescent up``
writes each process's drain setting where that role's settings take it (``launcher.py``), and the
chart's rendered configs are checked against the same classes (tests/helm). Names rather than
imports keep this module below every role; ``settings_class`` imports on demand.
"""

from __future__ import annotations

import importlib
from typing import Any

SERVICE_SETTINGS: dict[str, tuple[str, str]] = {
    "gateway": ("crescent.services.gateway.config", "GatewaySettings"),
    "scheduler": ("crescent.services.scheduler.config", "SchedulerSettings"),
    "prefill": ("crescent.services.prefill.config", "PrefillSettings"),
    "decode": ("crescent.services.decode.config", "DecodeSettings"),
    "aggregated": ("crescent.services.aggregated.config", "AggregatedSettings"),
    "kvstore": ("crescent.services.kvstore.config", "KvStoreSettings"),
}
ENGINE_ROLES = ("prefill", "decode", "aggregated")  # roles that run the model engine (and its workers)


def settings_module(role: str) -> Any:
    """The module holding ``role``'s settings class and its ``ENV_PREFIX``."""
    if role not in SERVICE_SETTINGS:
        raise KeyError(f"unknown role {role!r}; valid: {', '.join(SERVICE_SETTINGS)}")
    return importlib.import_module(SERVICE_SETTINGS[role][0])


def settings_class(role: str) -> Any:
    """``role``'s settings class (a pydantic model), imported now."""
    return getattr(settings_module(role), SERVICE_SETTINGS[role][1])
