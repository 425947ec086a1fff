"""What the instance tells its KV connector, which vLLM builds in its own processes (the engine
core's scheduler and each worker): passed as ``kv_connector_extra_config`` (JSON-able values
only), read back here. No vLLM import: the instance builds these before vLLM starts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

# vLLM's cache salt for a request whose prompt must leave nothing shared (Kimi's short-prompt
# rule): a fresh random salt per request, so its blocks hit nobody's, and the connector neither
# looks them up nor saves them.
PRIVATE_SALT_PREFIX = "private:"
TENANT_SALT_PREFIX = "crs:"
# A vLLM prefill's handoff of such a prompt to a vLLM decode (services/engine_vllm/handoff.py):
# a fresh random salt that only that prefill and that decode know. Its blocks are saved and
# loaded like a tenant's (the kvstore carries them across), never reported to the scheduler's
# prefix index, and never hit by another request.
HANDOFF_SALT_PREFIX = "handoff:"


@dataclass(frozen=True, slots=True)
class ConnectorOptions:
    model_id: str                 # Crescent's model id: part of every block key
    block_size: int               # tokens per block, Crescent's and vLLM's alike
    kvstore_address: str = ""     # empty: no kvstore (the connector only reports vLLM's cache)
    kvstore_shared_memory: bool = True
    lease_ms: int = 30_000
    events_socket: str = ""       # Unix socket the instance reads block events from ("" : none)
    tls_ca: str = ""              # this process's mutual TLS files, as the instance has them
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""
    # A prefill instance: its saves are how its prompts reach decode, so a full put queue holds
    # the step until there is room instead of dropping the blocks (decode would recompute them).
    saves_wait: bool = False

    def to_extra_config(self) -> dict[str, Any]:
        return {"crescent": asdict(self)}

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ConnectorOptions:
        given = dict(extra.get("crescent") or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"CrescentConnector: unknown option(s) {', '.join(unknown)}")
        if "model_id" not in given or "block_size" not in given:
            raise ValueError("CrescentConnector needs kv_connector_extra_config.crescent.model_id and .block_size")
        return cls(**given)


def tenant_salt(salt: bytes) -> str:
    """vLLM's cache salt for Crescent's per-tenant salt (vLLM folds it into its own first block hash)."""
    return TENANT_SALT_PREFIX + salt.hex()


def crescent_salt(vllm_salt: str | None) -> bytes | None:
    """The block-key salt back from vLLM's; None: a private prompt, never looked up nor saved."""
    if not vllm_salt:
        return b""
    if vllm_salt.startswith(PRIVATE_SALT_PREFIX):
        return None
    for prefix in (TENANT_SALT_PREFIX, HANDOFF_SALT_PREFIX):
        if vllm_salt.startswith(prefix):
            try:
                return bytes.fromhex(vllm_salt[len(prefix):])
            except ValueError:
                return None
    return None  # a salt Crescent did not set: treat the prompt as private


def shared_salt(vllm_salt: str | None) -> bool:
    """Whether blocks under this salt are for other requests too (reported to the prefix index)."""
    return not vllm_salt or vllm_salt.startswith(TENANT_SALT_PREFIX)


def loadable_blocks(prompt_tokens: int, block_size: int) -> int:
    """The leading prompt blocks the connector may load: every complete one but one ending at the
    prompt's last token (vLLM computes at least that token, to sample from)."""
    return (prompt_tokens - 1) // block_size
