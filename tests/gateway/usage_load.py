"""Many concurrent requests of every kind against a gateway, and what each client was told it used.

``send_all`` fires requests of five kinds at once — chat (non-streamed, and streamed with n = 2),
text completions with two prompts, responses (non-streamed and streamed) — and gives back, for
each, the id the client saw, whether the response arrived whole, and the usage it reported. A
streamed response is whole once its usage and its end came (``[DONE]``; ``response.completed``,
or ``response.incomplete`` when cut by ``max_output_tokens``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

KINDS = ("chat", "chat_stream_n2", "completions_2_prompts", "responses", "responses_stream")


@dataclass
class Outcome:
    kind: str
    key: str | None
    id: str | None = None
    whole: bool = False
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    error: str | None = None

    def ledger_ids(self) -> list[str]:
        """The ledger rows of this response (several prompts: one per prompt)."""
        assert self.id is not None
        return [f"{self.id}:0", f"{self.id}:1"] if self.kind == "completions_2_prompts" else [self.id]


def _request(kind: str, i: int, model: str, prefix: str) -> tuple[dict[str, object], bool]:
    """The body of request ``i`` and whether it streams; every 7th shares a prompt (cache hits)."""
    words = f"{prefix}shared prompt number {i % 7} with some words" if i % 3 else f"{prefix}prompt {i} alone here"
    chat = {"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": 6}
    if kind == "chat":
        return chat, False
    if kind == "chat_stream_n2":
        return chat | {"stream": True, "n": 2, "stream_options": {"include_usage": True}}, True
    if kind == "completions_2_prompts":
        return {"model": model, "prompt": [words, f"{words} again"], "max_tokens": 4}, False
    body = {"model": model, "input": words, "max_output_tokens": 6, "store": False}
    return (body | {"stream": True}, True) if kind == "responses_stream" else (body, False)


def _take_usage(outcome: Outcome, usage: dict[str, object]) -> None:
    if "input_tokens" in usage:  # the Responses API's names
        outcome.prompt, outcome.completion = usage["input_tokens"], usage["output_tokens"]  # type: ignore[assignment]
        outcome.cached = usage["input_tokens_details"]["cached_tokens"]  # type: ignore[index]
    else:
        outcome.prompt, outcome.completion = usage["prompt_tokens"], usage["completion_tokens"]  # type: ignore[assignment]
        outcome.cached = usage["prompt_tokens_details"]["cached_tokens"]  # type: ignore[index]


async def _one(client: httpx.AsyncClient, outcome: Outcome, body: dict[str, object], stream: bool) -> None:
    path = "/v1/responses" if outcome.kind.startswith("responses") else (
        "/v1/completions" if outcome.kind.startswith("completions") else "/v1/chat/completions")
    headers = {"Authorization": f"Bearer {outcome.key}"} if outcome.key else {}
    if not stream:
        reply = await client.post(path, json=body, headers=headers)
        if reply.status_code != 200:
            outcome.error = f"{reply.status_code} {reply.text[:200]}"
            return
        answer = reply.json()
        outcome.id = answer["id"]
        _take_usage(outcome, answer["usage"])
        outcome.whole = True
        return
    async with client.stream("POST", path, json=body, headers=headers) as reply:
        if reply.status_code != 200:
            outcome.error = f"{reply.status_code}"
            return
        event = ""
        usage_seen = False
        async for line in reply.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                outcome.whole = usage_seen
                continue
            data = json.loads(line[6:])
            outcome.id = outcome.id or data.get("id") or data.get("response", {}).get("id")
            if event in ("response.completed", "response.incomplete"):  # incomplete: cut by max_output_tokens
                _take_usage(outcome, data["response"]["usage"])
                outcome.whole = True
            elif data.get("usage"):
                _take_usage(outcome, data["usage"])
                usage_seen = True


async def send_all(base_url: str, keys: Sequence[str | None], count: int, model: str, *, prefix: str = "",
                   on_done: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """``count`` requests at once, kind and key taken in turn; a failed request is an ``Outcome``
    with ``error`` (or cut short: not ``whole``), never an exception."""
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120) as client:
        async def run(i: int) -> Outcome:
            outcome = Outcome(KINDS[i % len(KINDS)], keys[i % len(keys)])
            body, stream = _request(outcome.kind, i, model, prefix)
            try:
                await _one(client, outcome, body, stream)
            except (httpx.HTTPError, json.JSONDecodeError) as exc:  # whole stays as it was: [DONE] may have come
                outcome.error = f"{exc.__class__.__name__}: {exc}"
            if on_done is not None:
                on_done(outcome)
            return outcome

        return list(await asyncio.gather(*(run(i) for i in range(count))))
