"""Streaming load through the real ``openai`` client, recording what each client saw.

Per request: the HTTP status (and Retry-After / error code of a refusal), every content chunk
with its arrival time, the finish_reason, whether ``data: [DONE]`` or an error event came (read
from the raw bytes: the client swallows ``[DONE]``), and a transport error if the connection
broke. The raw bytes come from a transport that tees each response tagged with a probe header.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field

import httpx
import openai

PROBE_HEADER = "x-crescent-fault-probe"
SYSTEM_PROMPT = (
    "You are the narrator of a long serial story. Each reply continues the story in plain prose, "
    "with vivid detail about the places, the weather, the food and the people the travellers meet. "
    "Never use lists or headings, never stop early, and never address the reader directly. "
) * 2
TOPICS = [
    "a lighthouse keeper who finds a map", "two sisters crossing a desert", "a clockmaker in Prague",
    "a ship's cat on a trade route", "a baker who opens a night market", "an astronomer on a mountain",
    "a boy who repairs radios", "a caravan of musicians", "a librarian under a flooded city",
    "a gardener on a space station", "a fisherman and a talking gull", "a postwoman in the Arctic",
]


@dataclass(frozen=True, slots=True)
class Prompt:
    """One chat request's messages; ``cache_salt`` keeps runs from sharing prefix blocks."""

    user: str
    system: str = SYSTEM_PROMPT

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.user}]


def story_prompts(n: int, system: str = SYSTEM_PROMPT) -> list[Prompt]:
    """Prompts sharing a system prompt of a few KV blocks (so the kvstore serves prefixes)."""
    return [Prompt(f"Tell the story of {TOPICS[i % len(TOPICS)]} (part {i // len(TOPICS) + 1}).", system)
            for i in range(n)]


_WORDS = ("river stone lantern harbor copper meadow signal winter orchard canyon ember glacier "
          "compass velvet thunder quarry saffron beacon tundra marble falcon willow cinder prairie").split()


def document_prompts(n: int, words: int, tag: str = "doc") -> list[Prompt]:
    """Prompts of about ``words`` * 1.5 tokens that share no prefix block with each other, so
    each one is computed in full by prefill."""
    prompts = []
    for i in range(n):
        rng = random.Random(f"{tag}-{i}")
        body = " ".join(rng.choice(_WORDS) for _ in range(words))
        prompts.append(Prompt(f"Summarise these notes in a story: {body}", system=f"Archive {tag} number {i}."))
    return prompts


def short_answer_prompts(n: int, words: int, tag: str = "question") -> list[Prompt]:
    """Yes/no questions about ~``words`` * 1.3 tokens of notes: the model answers in 3 to 15
    tokens (sent with ``ignore_eos=False``), sharing no prefix block with each other."""
    prompts = []
    for i in range(n):
        rng = random.Random(f"{tag}-{i}")
        body = " ".join(rng.choice(_WORDS) for _ in range(words))
        prompts.append(Prompt(f"Notes: {body}\nDoes the word 'river' appear in these notes? Answer yes or no.",
                              system=f"You answer with one word. Archive {tag} {i}."))
    return prompts


@dataclass
class StreamResult:
    prompt: Prompt
    started: float
    status: int | None = None          # HTTP status; None when no response came at all
    retry_after: str | None = None     # the Retry-After header of a refusal
    error_code: str | None = None      # the error body's code (refusal) or the error event's
    error_message: str | None = None
    chunks: list[tuple[float, str]] = field(default_factory=list)  # (monotonic time, content)
    finish_reason: str | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    done: bool = False                 # data: [DONE] arrived
    error_event: bool = False          # data: {"error": ...} arrived after the 200
    transport_error: str | None = None  # the connection broke or never opened
    ended: float | None = None
    completion_id: str | None = None   # the chunks' id: the gateway logs each re-placement under it

    @property
    def text(self) -> str:
        return "".join(c for _, c in self.chunks)

    @property
    def first_token_at(self) -> float | None:
        return self.chunks[0][0] if self.chunks else None

    @property
    def completed(self) -> bool:
        """A 200 that ended the normal way: a finish_reason, [DONE], no error on the way."""
        return (self.status == 200 and self.finish_reason in ("stop", "length") and self.done
                and not self.error_event and self.transport_error is None)

    @property
    def aborted_after_accept(self) -> bool:
        return self.status == 200 and not self.completed

    def max_gap(self, after: float = 0.0) -> float:
        """Longest wait between consecutive chunks among those that arrived after ``after``
        (the wait that led up to such a chunk counts); the wait from the request to its first
        chunk is TTFT, not a gap."""
        times = [t for t, _ in self.chunks]
        gaps = [b - a for a, b in zip(times, times[1:]) if b > after]
        return max(gaps, default=0.0)

    def describe(self) -> str:
        end = "[DONE]" if self.done else "no [DONE]"
        return (f"status={self.status} finish={self.finish_reason} {end} chunks={len(self.chunks)} "
                f"tokens={self.completion_tokens} error_event={self.error_event} code={self.error_code} "
                f"transport={self.transport_error} msg={self.error_message!r}")


class _TeeStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, sink: bytearray) -> None:
        self._inner = inner
        self._sink = sink

    async def __aiter__(self):
        async for chunk in self._inner:
            self._sink.extend(chunk)
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class RecordingTransport(httpx.AsyncBaseTransport):
    """Keeps the raw body of every response whose request carries ``PROBE_HEADER``."""

    def __init__(self) -> None:
        self._inner = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=256))
        self.raw: dict[str, bytearray] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        tag = request.headers.get(PROBE_HEADER)
        if tag is not None:
            response.stream = _TeeStream(response.stream, self.raw.setdefault(tag, bytearray()))
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class LoadClient:
    """An ``AsyncOpenAI`` client against one gateway, recording each stream."""

    def __init__(self, base_url: str, model: str, timeout_s: float = 300) -> None:
        self.model = model
        self.transport = RecordingTransport()
        self.client = openai.AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key="fault-suite", max_retries=0,
            http_client=httpx.AsyncClient(transport=self.transport, timeout=timeout_s),
        )

    async def close(self) -> None:
        await self.client.close()

    async def __aenter__(self) -> LoadClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def stream(self, prompt: Prompt, max_tokens: int, *, salt: str, ignore_eos: bool = True,
                     record: StreamResult | None = None) -> StreamResult:
        """One streamed chat completion at temperature 0, recorded into ``record`` as it goes
        (so that it can be read while the stream runs)."""
        tag = uuid.uuid4().hex
        result = record if record is not None else StreamResult(prompt, started=time.monotonic())
        try:
            stream = await self.client.chat.completions.create(
                model=self.model, messages=prompt.messages(), max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": ignore_eos, "cache_salt": salt},
                extra_headers={PROBE_HEADER: tag},
            )
            result.status = stream.response.status_code
            async with stream:
                async for chunk in stream:
                    now = time.monotonic()
                    result.completion_id = result.completion_id or chunk.id
                    if chunk.usage is not None:
                        result.completion_tokens = chunk.usage.completion_tokens
                        result.prompt_tokens = chunk.usage.prompt_tokens
                    for choice in chunk.choices:
                        if choice.delta.content:
                            result.chunks.append((now, choice.delta.content))
                        if choice.finish_reason is not None:
                            result.finish_reason = choice.finish_reason
        except openai.APIStatusError as exc:  # refused before the stream started
            result.status = exc.status_code
            result.retry_after = exc.response.headers.get("retry-after")
            body = exc.body if isinstance(exc.body, dict) else {}
            body = body.get("error", body) if isinstance(body.get("error", body), dict) else body
            result.error_code = body.get("code")
            result.error_message = body.get("message") or str(exc)
        except openai.APIConnectionError as exc:  # no response at all, or it broke while read
            result.transport_error = f"{type(exc).__name__}: {exc.__cause__ or exc}"
        except openai.APIError as exc:  # an error event inside a 200 stream
            result.error_event = True
            body = exc.body if isinstance(exc.body, dict) else {}
            result.error_code = body.get("code")
            result.error_message = exc.message
        except httpx.HTTPError as exc:  # the connection broke mid-stream
            result.transport_error = f"{type(exc).__name__}: {exc}"
        finally:
            result.ended = time.monotonic()
            raw = bytes(self.transport.raw.pop(tag, b""))
            result.done = b"data: [DONE]" in raw
            result.error_event = result.error_event or _has_error_event(raw, result.status)
        return result


def _has_error_event(raw: bytes, status: int | None) -> bool:
    if status != 200:
        return False
    for line in raw.decode(errors="replace").splitlines():
        if line.startswith("data: {"):
            try:
                if "error" in json.loads(line[len("data: "):]):
                    return True
            except json.JSONDecodeError:
                continue
    return False


class StreamingLoad:
    """Streams running in the background, their records readable while they run."""

    def __init__(self, client: LoadClient, max_tokens: int, salt: str) -> None:
        self.client = client
        self.max_tokens = max_tokens
        self.salt = salt
        self.records: list[StreamResult] = []
        self.tasks: list[asyncio.Task[StreamResult]] = []

    def add(self, prompt: Prompt, **kwargs) -> StreamResult:
        record = StreamResult(prompt, started=time.monotonic())
        self.records.append(record)
        self.tasks.append(asyncio.create_task(
            self.client.stream(prompt, self.max_tokens, salt=self.salt, record=record, **kwargs)))
        return record

    def add_all(self, prompts: list[Prompt]) -> list[StreamResult]:
        return [self.add(p) for p in prompts]

    async def wait_streaming(self, min_chunks: int, timeout_s: float = 120) -> None:
        """Until every stream started so far has ``min_chunks`` content chunks (or has ended), so
        that a fault lands mid-stream."""
        deadline = time.monotonic() + timeout_s
        while not all(len(r.chunks) >= min_chunks or r.ended is not None for r in self.records):
            if time.monotonic() > deadline:
                raise TimeoutError(f"streams did not reach {min_chunks} chunks: {[len(r.chunks) for r in self.records]}")
            await asyncio.sleep(0.05)

    async def results(self, timeout_s: float = 300) -> list[StreamResult]:
        """Every stream's record once all have ended (a stream still open after ``timeout_s`` is
        a hang: TimeoutError)."""
        await asyncio.wait_for(asyncio.gather(*self.tasks, return_exceptions=True), timeout_s)
        return self.records

    async def hang_up(self) -> float:
        """The clients go away (as a closed browser tab would): every stream still open is
        cancelled, which closes its connection. Returns the moment they went (monotonic)."""
        at = time.monotonic()
        for task, record in zip(self.tasks, self.records):
            if not task.done():
                record.transport_error = "the client hung up"
                task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        return at
