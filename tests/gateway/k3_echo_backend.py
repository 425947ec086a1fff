"""The fake backend reading and writing Kimi K3 prompts and replies with the real Kimi vocabulary.

A gateway serving kimi-k3-nano sends prompts in K3's XTML format; this is ``fake_backend``
speaking K3's vocabulary (``vocab``, a ``fake_backend.Vocab``; the tokenizer read from
``../shared/kimi-tokenizer`` as the model source resolves it), so a test scripts the model's reply
by sending it as the last user message: the gateway encodes that message as plain text, this
backend echoes it with K3's markup tokens (``<|open|>``, ``<|sep|>``, ...) as the model would
write them, then ``<|end_of_msg|>``. In the test process: ``InProcessBackend(vocab=vocab())``.

Run as a process: ``python -m tests.gateway.k3_echo_backend --port P --control-port C --block-size B``.
"""

from __future__ import annotations

import re

from crescent.services.model.kimi_tokenizer import tokenizer_for
from crescent.services.model.model_source import resolve_model

from tests.gateway import fake_backend


def vocab() -> fake_backend.Vocab:
    """K3's chat markup as the fake backend reads and writes it."""
    tokenizer = tokenizer_for(resolve_model("kimi-k3-nano"))
    return fake_backend.Vocab(
        tokenizer, chat_start=tokenizer.token_to_id("<|open|>"),  # "this is a chat prompt"
        reply_end=tokenizer.token_to_id("<|end_of_msg|>"),  # ends every reply
        last_user=re.compile(r'<\|open\|>message role="user"<\|sep\|>(.*?)<\|close\|>message<\|sep\|>', re.S))


def main() -> None:
    fake_backend.main(vocab)


if __name__ == "__main__":
    main()
