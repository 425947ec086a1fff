"""The role -> settings map names real classes, each with its env prefix."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from crescent.services.contract.roles import ENGINE_ROLES, SERVICE_SETTINGS, settings_class, settings_module


@pytest.mark.parametrize("role", sorted(SERVICE_SETTINGS))
def test_every_role_names_a_settings_model_with_an_env_prefix(role: str) -> None:
    assert issubclass(settings_class(role), BaseModel)
    assert settings_module(role).ENV_PREFIX.startswith("CRESCENT_")
    assert set(ENGINE_ROLES) <= set(SERVICE_SETTINGS)


def test_an_unknown_role_lists_the_valid_ones() -> None:
    with pytest.raises(KeyError, match="valid: gateway, scheduler"):
        settings_class("router")
