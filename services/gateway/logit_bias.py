"""``logit_bias`` as the engines take it, the same on every endpoint."""

from __future__ import annotations

from crescent.services.gateway.errors import InvalidRequestError


def token_biases(logit_bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs; a key that is not a token id of this model is a 400."""
    pairs = []
    for key, bias in (logit_bias or {}).items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise InvalidRequestError(f"logit_bias key {key!r} is not a token id of this model (0 to {vocab_size - 1})",
                                      param="logit_bias", code="invalid_value")
        pairs.append((int(key), bias))
    return tuple(sorted(pairs))
