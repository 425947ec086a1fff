"""The fake backend reading and writing Kimi K3 prompts and replies with the real Kimi vocabulary.

A gateway serving kimi-k3-nano sends prompts in K3's XTML format; this runs ``fake_backend`` with
K3's tokenizer, so a test scripts the model's reply by sending it as the last user message: the
gateway encodes that message as plain text, this backend echoes it with K3's markup tokens
(``<|open|>``, ``<|sep|>``, ...) as the model would write them, then ``<|end_of_msg|>``.

Run: ``python -m tests.gateway.k3_echo_backend --port P --control-port C --block-size B``.
"""

from __future__ import annotations

import re

from crescent.services.model.kimi_tokenizer import tokenizer_for
from crescent.services.model.model_source import resolve_model

from tests.gateway import fake_backend


def main() -> None:
    tokenizer = tokenizer_for(resolve_model("kimi-k3-nano"))
    fake_backend.TOKENIZER = tokenizer  # type: ignore[assignment]  # the same encode/decode methods
    fake_backend.IM_START = tokenizer.token_to_id("<|open|>")  # type: ignore[misc]  # "this is a chat prompt"
    fake_backend.IM_END = tokenizer.token_to_id("<|end_of_msg|>")  # type: ignore[misc]  # ends every reply
    fake_backend._LAST_USER = re.compile(  # type: ignore[misc]
        r'<\|open\|>message role="user"<\|sep\|>(.*?)<\|close\|>message<\|sep\|>', re.S)
    fake_backend.main()


if __name__ == "__main__":
    main()
