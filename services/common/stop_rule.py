"""The one stop rule on the request path: which sampled token ids end a request.

The gateway sends the ids it wants to stop on (``SamplingParams.stop_token_ids``) and whether
end-of-sequence is ignored; prefill and decode both apply exactly this function, with the
model's end-of-sequence ids, so the three services can never disagree about when a request
is finished. Stop *strings* are text and stay with the gateway, which owns the tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable


def stop_token_ids(requested: Iterable[int], eos_token_ids: Iterable[int], ignore_eos: bool) -> frozenset[int]:
    """The ids that end a request: those asked for, plus the model's EOS ids unless ignored."""
    stop = set(requested)
    if not ignore_eos:
        stop.update(eos_token_ids)
    return frozenset(stop)
