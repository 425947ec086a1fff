"""Structured outputs: a grammar matcher per request masks the tokens its output may not take.

The grammar engine is llguidance (docs/structured-outputs.md says why it was chosen over
xgrammar): it builds its token trie from the model's own tokenizer, Hugging Face ``tokenizers``
JSON or Kimi's tiktoken ranks alike, and computes a step's mask in tens of microseconds.

A ``Constraint`` message (JSON schema, any JSON object, regex, choice, Lark grammar) becomes
llguidance grammar text with ``services.model.grammar`` (torch-free: the gateway validates with it).
``ConstraintCompiler.compile`` turns it into a ``TokenConstraint`` for one request, replaying
the tokens the request already generated (after a migration, or decode continuing prefill's
first token). Each step: ``allowed()`` gives the mask (computed while the forward runs), the
sampled token goes to ``advance``; once the grammar is complete only end-of-sequence is allowed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.tiktoken
import numpy as np
import torch

from crescent.protos import common_pb2
from crescent.services.model.grammar import ConstraintError, grammar_text

__all__ = ["ConstraintCompiler", "ConstraintError", "Constraints", "TokenConstraint", "compile_constraint",
           "submit_masks"]

log = logging.getLogger(__name__)

# Masks are computed here while the engine thread runs the forward (llguidance drops the GIL).
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="constraint-masks")

class TokenConstraint:
    """One request's matcher: ``allowed`` for the next token, ``advance`` with the sampled one."""

    __slots__ = ("_matcher", "_vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """A bool (vocab,) mask; ids beyond the tokenizer's vocabulary (padding rows) are never allowed."""
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        mask = np.zeros(self._vocab_size, dtype=bool)
        n = min(self._vocab_size, bits.shape[0])
        mask[:n] = bits[:n]
        return torch.from_numpy(mask)

    def advance(self, token_id: int) -> None:
        """Take the sampled token; ``ConstraintError`` if the grammar cannot take it (a bug, never the model's)."""
        if not self._matcher.consume_token(int(token_id)):
            raise ConstraintError(f"the grammar refused token {token_id}: {self._matcher.get_error()}")

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class ConstraintCompiler:
    """Compiles constraints against one model's tokenizer (built once: about a quarter second)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size

    @classmethod
    def for_model(cls, model_spec: str, vocab_size: int, stop_token_ids: Sequence[int]) -> ConstraintCompiler:
        """The compiler for a model spec (as ``engine.model`` names it) and its logits width."""
        from crescent.services.model.kimi_tokenizer import KimiTokenizer, tokenizer_for
        from crescent.services.model.model_source import resolve_model

        tokenizer = tokenizer_for(resolve_model(model_spec))
        eos = list(dict.fromkeys([*stop_token_ids, *tokenizer.eos_token_ids]))
        if isinstance(tokenizer, KimiTokenizer):
            ll = llguidance.tiktoken.lltokenizer_from_encoding(tokenizer.encoding, eos_token=eos)
        else:
            ll = llguidance.LLTokenizer(tokenizer.hf_json(), eos_token=eos)
        return cls(ll, vocab_size)

    def compile(self, constraint: common_pb2.Constraint, generated: Sequence[int] = ()) -> TokenConstraint | None:
        """A fresh matcher that has consumed ``generated``; None for an unconstrained request."""
        grammar = grammar_text(constraint)
        if grammar is None:
            return None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(matcher.get_error())
        if generated and not matcher.consume_tokens([int(t) for t in generated]):
            raise ConstraintError(f"the tokens generated so far do not fit the constraint: {matcher.get_error()}")
        return TokenConstraint(matcher, self._vocab_size)


def submit_masks(constraints: Sequence[TokenConstraint | None]) -> Future[list[torch.Tensor | None]]:
    """Start computing each row's next-token mask (None rows stay None) on the mask threads."""
    return _POOL.submit(lambda: [c.allowed() if c is not None else None for c in constraints])


class Constraints:
    """An engine's structured-output side: the compiler, built on first use (the tokenizer's
    token table takes seconds to build, and most engines never see a constrained request)."""

    def __init__(self, build: Callable[[], ConstraintCompiler]) -> None:
        self._build = build
        self._compiler: ConstraintCompiler | None = None
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, model_spec: str, vocab_size: int, stop_token_ids: Sequence[int]) -> Constraints:
        return cls(lambda: ConstraintCompiler.for_model(model_spec, vocab_size, stop_token_ids))

    def _compiler_now(self) -> ConstraintCompiler:
        with self._lock:
            if self._compiler is None:
                log.info("building the grammar engine's token table for structured outputs")
                self._compiler = self._build()
            return self._compiler

    async def compile(self, constraint: common_pb2.Constraint, generated: Sequence[int] = ()) -> TokenConstraint | None:
        """``ConstraintCompiler.compile`` off the event loop; None when nothing is constrained."""
        if constraint.WhichOneof("kind") is None:
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_POOL, lambda: self._compiler_now().compile(constraint, generated))


async def compile_constraint(constraints: Constraints | None, sampling: common_pb2.SamplingParams,
                             generated: Sequence[int]) -> TokenConstraint | None:
    """A request's matcher (None: unconstrained); ``ConstraintError`` when it cannot be served here."""
    if sampling.constraint.WhichOneof("kind") is None:
        return None
    if constraints is None:
        raise ConstraintError("this instance serves no structured outputs")
    return await constraints.compile(sampling.constraint, generated)
