"""``POST /v1/completions``: validate, tokenize the prompts, generate every choice, answer or stream.

Each prompt of the request has ``n`` choices (index = prompt index * n + i, as OpenAI numbers
them); each prompt is a backend request ``<response id>-<prompt index>`` whose choices the
backend serves together (``choices``: the prompt is prefilled once). Each prompt is one request
in the gateway's metrics (TTFT, TBT and tokens), as vLLM counts them; its n choices count as
one. As in chat, errors
before the first token are plain HTTP errors even for streaming requests: the stream starts once
every prompt's choice 0 has its first event, and a failure of any choice before then cancels
the others. A client that goes away, streaming or not, cancels every choice.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from functools import partial

from crescent.services.common.metrics import GatewayMetrics
from crescent.services.contract.finish import stop_token_ids
from crescent.services.gateway.accounting import RequestRecord, RequestStatus, UsageCounts, response_usage
from crescent.services.gateway.auth import Principal, principal_of
from crescent.services.gateway.backend import Backend, GenerationRequest, RequestId, Sampling
from crescent.services.gateway.choice_stream import ChoiceStream, status_of
from crescent.services.gateway.choices import collect_choices, leaders_first, resumed
from crescent.services.gateway.client_gone import ClientGone, unless_disconnected
from crescent.services.gateway.completions.prompt import CompletionPrompt, build_completion_prompts
from crescent.services.gateway.completions.api import (
    MAX_CHOICES_PER_REQUEST,
    CompletionChoice,
    CompletionRequest,
    TextCompletion,
)
from crescent.services.gateway.completions.stream import CompletionChunks
from crescent.services.gateway.drain import Drain
from crescent.services.gateway.errors import (
    ApiError,
    InvalidRequestError,
    ModelNotFoundError,
    UnsupportedParameterError,
)
from crescent.services.gateway.generation import Finished, GenerationEvent, TextDelta, generate_text
from crescent.services.gateway.limits.http import admit
from crescent.services.gateway.ledger import UsageLedger
from crescent.services.gateway.logit_bias import token_biases
from crescent.services.gateway.logprobs import ReportedToken, TokenLogprobs, completion_logprobs
from crescent.services.gateway.prompt import ServedModel
from crescent.services.gateway.sse import ChunkHeader, SseResponse, usage_model
from crescent.services.tenancy import cache_salt
from fastapi import Request
from fastapi.responses import JSONResponse, Response

log = logging.getLogger(__name__)

Events = AsyncGenerator[GenerationEvent, None]


async def _collect(events: Events, first: GenerationEvent | None) -> tuple[str, Finished, list[ReportedToken]]:
    parts: list[str] = []
    entries: list[ReportedToken] = []
    async with aclosing(resumed(first, events)) as events:
        async for event in events:
            if isinstance(event, TextDelta):
                parts.append(event.text)
            elif isinstance(event, TokenLogprobs):
                entries.extend(event.entries)
            elif isinstance(event, Finished):
                return "".join(parts), event, entries
    raise AssertionError("generate_text always ends with Finished or an error")


class Completions:
    def __init__(self, backend: Backend, model: ServedModel, metrics: GatewayMetrics, drain: Drain,
                 served_name: str, ledger: UsageLedger | None = None) -> None:
        self._backend = backend
        self._ledger = ledger
        self._model = model
        self._metrics = metrics
        self._drain = drain
        self.served_name = served_name

    async def _prompts(self, body: CompletionRequest) -> list[CompletionPrompt]:
        if body.model != self.served_name:
            raise ModelNotFoundError(
                f"the model {body.model!r} does not exist; this gateway serves {self.served_name!r}", param="model"
            )
        unsupported = body.unsupported_values()
        if unsupported:
            param, why = unsupported[0]
            raise UnsupportedParameterError(f"unsupported value for {param}: {why}", param=param)
        choices = len(body.prompts()) * body.n
        if choices > MAX_CHOICES_PER_REQUEST:
            raise InvalidRequestError(
                f"{len(body.prompts())} prompts with n={body.n} make {choices} choices; "
                f"a request has at most {MAX_CHOICES_PER_REQUEST}", param="n", code="invalid_value")
        # Tokenizing long prompts takes milliseconds of CPU: keep it off the event loop.
        return await asyncio.to_thread(build_completion_prompts, body, self._model)

    def _generation_request(self, body: CompletionRequest, request_id: RequestId,
                            prompt: CompletionPrompt, principal: Principal) -> GenerationRequest:
        # The one stop rule: engines apply the same function with their own EOS ids.
        stops = stop_token_ids((), self._model.tokenizer.eos_token_ids, body.ignore_eos)
        return GenerationRequest(
            request_id=request_id,
            model_id=self._model.model_id,
            prompt_token_ids=prompt.token_ids,
            cache_salt=cache_salt(principal.salt, body.cache_salt),  # the tenant's, narrowed by the client's
            sampling=Sampling(
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=max(body.top_k, 0),
                seed=body.seed,
                max_tokens=prompt.max_tokens,
                stop_token_ids=tuple(sorted(stops)),
                ignore_eos=body.ignore_eos,
                logprobs=body.logprobs,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                logit_bias=token_biases(body.logit_bias, self._model.tokenizer.vocab_size),
            ),
        )

    def _record(self, ledger_id: str, request: Request) -> RequestRecord:
        """A prompt's record, priced into the ledger as ``ledger_id`` (the response id; with several
        prompts, ``<response id>:<prompt index>``) when there is a ledger."""
        account = None if self._ledger is None else self._ledger.account(ledger_id, principal_of(request),
                                                                          self.served_name)
        return RequestRecord(self._metrics, account=account)

    async def handle(self, body: CompletionRequest, request: Request) -> Response:
        response_id = f"cmpl-{uuid.uuid4().hex}"
        log.info("completion %s", response_id)  # links the HTTP request id in log records to this one
        count = len(body.prompts())
        records = [self._record(response_id if count == 1 else f"{response_id}:{p}", request) for p in range(count)]

        def finish_all(status: RequestStatus) -> None:
            for record in records:
                record.finish(status)  # a no-op for the records already finished

        try:
            prompts = await self._prompts(body)
            stops = body.stop_strings()
            n = body.n
            principal = principal_of(request)
            requests = [self._generation_request(body, RequestId(f"{response_id}-{p}"), prompt, principal)
                        for p, prompt in enumerate(prompts)]
            await admit(request, self.served_name, requests, n, records)  # the key's and tenant's limits
            sources = [choice for r in requests for choice in self._backend.generate_choices(r, n)]
            leaders = range(0, len(sources), n)  # each prompt's choice 0
            choice_records = [records[k // n] for k in range(len(sources))]
            header = ChunkHeader(
                request_id=response_id,
                created=int(time.time()),
                model=self.served_name,
                include_usage=body.stream_options is not None and body.stream_options.include_usage,
            )
            echoes = [prompts[k // n].text if body.echo else "" for k in range(len(sources))]
            # Every choice is closed however the response ends, read or not (``owning``).
            events = [generate_text(s, self._model.tokenizer, requests[k // n], stops, choice_records[k], choice=k % n)
                      for k, s in enumerate(sources)]
            if not body.stream:
                collected = await unless_disconnected(request, self._drain.race(
                    collect_choices(events, leaders, _collect)))
                finish_all("ok")
                for record in records:
                    await record.committed()  # a client that has its answer is in the usage ledger
                completion = _completion(header, echoes, collected, n, logprobs=body.logprobs is not None)
                return JSONResponse(completion.model_dump())
            firsts = await unless_disconnected(request, self._drain.race(leaders_first(events, leaders)))
            return SseResponse(ChoiceStream(CompletionChunks(header, echoes), events, firsts, choice_records,
                                            partial(response_usage, n=n), self._drain))
        except ApiError as exc:
            log.info("request failed: %s %s", exc.status, exc.message)
            finish_all(status_of(exc))
            raise
        except ClientGone:
            log.info("client disconnected before the first token")
            finish_all("cancelled")
            return Response(status_code=499)  # nobody reads it; the status is for access logs
        except asyncio.CancelledError:
            finish_all("cancelled")
            raise
        except Exception:
            finish_all("error")
            raise


def _completion(header: ChunkHeader, echoes: list[str], collected: list[tuple[str, Finished, list[ReportedToken]]],
                n: int, *, logprobs: bool = False) -> TextCompletion:
    usages: list[UsageCounts] = [finished.usage for _, finished, _ in collected]
    return TextCompletion(
        id=header.request_id, created=header.created, model=header.model,
        choices=[
            CompletionChoice(index=i, text=echo + text, finish_reason=finished.finish_reason,  # type: ignore[arg-type]
                             logprobs=completion_logprobs(entries) if logprobs else None)
            for i, (echo, (text, finished, entries)) in enumerate(zip(echoes, collected))
        ],
        usage=usage_model(response_usage(usages, n)),
    )
