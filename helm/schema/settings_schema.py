"""The schema of each component's ``settings`` value: the settings model its service loads
(pydantic), read as partial overrides. The chart merges ``settings`` into the config it renders,
and the service refuses an unknown or misspelt key at start-up (``StrictModel``); with this
schema ``helm install`` refuses it first, naming the key, instead of a pod crash-looping.

Read as overrides: no key is required (the chart renders the rest), and a number or a boolean may
come as a string, as ``helm --set`` and YAML authors write them and pydantic accepts them.
"""

from __future__ import annotations

from typing import Any

from crescent.services.contract.roles import settings_class

_SCALARS = {"integer", "number", "boolean"}
_DROPPED = {"title", "default", "required", "examples"}


def settings_schema(component: str) -> dict[str, Any]:
    schema = settings_class(component).model_json_schema(mode="validation")
    definitions = schema.pop("$defs", {})
    return _as_overrides(_inlined(schema, definitions))


def _inlined(node: Any, definitions: dict[str, Any]) -> Any:
    """``node`` with every ``$ref`` to pydantic's ``$defs`` replaced by the definition (the
    schema is embedded deep inside the chart's, where those references would not resolve)."""
    if isinstance(node, list):
        return [_inlined(item, definitions) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = definitions[node["$ref"].removeprefix("#/$defs/")]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _inlined(merged, definitions)
    return {key: _inlined(value, definitions) for key, value in node.items()}


def _as_overrides(node: Any) -> Any:
    if isinstance(node, list):
        return [_as_overrides(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key == "properties":  # property names are data here, not keywords
            out[key] = {name: _as_overrides(sub) for name, sub in value.items()}
        elif key == "type":
            types = value if isinstance(value, list) else [value]
            widened = types + (["string"] if _SCALARS & set(types) and "string" not in types else [])
            out[key] = widened if len(widened) > 1 else widened[0]
        else:
            out[key] = _as_overrides(value)
    return out
