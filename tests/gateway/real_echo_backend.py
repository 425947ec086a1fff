"""The fake backend reading prompts and writing replies with the default model's real tokenizer.

``fake_backend`` decodes a prompt and encodes its echo with the fake tokenizer; a gateway that
serves SmolLM2 (the production entry) sends real token ids, so this runs the same backend with
SmolLM2's tokenizer instead: a test still scripts the reply by sending it as the last user
message, and the gateway detokenizes it as it would a real model's tokens.

Run: ``python -m tests.gateway.real_echo_backend --port P --control-port C --block-size B``.
"""

from __future__ import annotations

from crescent.services.model.model_source import DEFAULT_MODEL, resolve_model
from crescent.services.model.tokenizer import Tokenizer

from tests.gateway import fake_backend


def main() -> None:
    tokenizer = Tokenizer.for_model(resolve_model(DEFAULT_MODEL))
    # The fake backend ends every reply with token IM_END and stops there: it must be <|im_end|> here too.
    if tokenizer.token_to_id("<|im_end|>") != fake_backend.IM_END:
        raise SystemExit(f"{DEFAULT_MODEL}'s <|im_end|> is not token {fake_backend.IM_END}")
    fake_backend.TOKENIZER = tokenizer  # type: ignore[assignment]  # the same encode/decode methods
    fake_backend.main()


if __name__ == "__main__":
    main()
