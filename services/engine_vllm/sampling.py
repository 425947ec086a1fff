"""Crescent's ``SamplingParams`` (what the gateway accepted) as vLLM's.

Every field maps; what vLLM would do differently from the native engine is said here, not
hidden: seeds are per choice as Crescent derives them (``choice_seed``), but a migrated stream
(``first_step`` > 0) cannot continue vLLM's random sequence where it stopped, so it goes on with
a fresh draw from the same seed (greedy streams continue exactly); penalties count the tokens
vLLM generated, so after a migration the streamed tokens count as prompt. Structured outputs are
enforced by vLLM's guidance backend (llguidance, the engine the native backend uses too: the
same JSON Schema, regex, choice and Lark grammar syntax).
"""

from __future__ import annotations

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

from crescent.protos import common_pb2
from crescent.services.contract.choices import choice_seed
from crescent.services.engine.logprobs import MAX_TOP_LOGPROBS


class UnsupportedSampling(ValueError):
    """A request the vLLM backend cannot honour exactly; the message is for the client (400)."""


def structured_outputs(constraint: common_pb2.Constraint) -> StructuredOutputsParams | None:
    kind = constraint.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_schema":
        return StructuredOutputsParams(json=constraint.json_schema)
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "regex":
        return StructuredOutputsParams(regex=constraint.regex)
    if kind == "choice":
        if not constraint.choice.choices:
            raise UnsupportedSampling("a choice constraint needs at least one choice")
        return StructuredOutputsParams(choice=list(constraint.choice.choices))
    if kind == "grammar":
        return StructuredOutputsParams(grammar=constraint.grammar)
    raise UnsupportedSampling(f"constraint {kind!r} is not supported by the vLLM backend")


def vllm_sampling(params: common_pb2.SamplingParams, index: int = 0) -> SamplingParams:
    """vLLM's parameters for choice ``index`` of a request (each choice runs as its own vLLM request)."""
    if params.logprobs and not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise UnsupportedSampling(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
    first_step = max(params.first_step, 0)
    seed = choice_seed(params.seed if params.has_seed else None, index)
    return SamplingParams(
        n=1,
        temperature=max(params.temperature, 0.0),
        top_p=params.top_p if 0 < params.top_p <= 1 else 1.0,
        top_k=max(params.top_k, 0),
        seed=seed,
        max_tokens=max(params.max_tokens, 1),
        min_tokens=max(params.min_tokens - first_step, 0),  # the client has first_step tokens already
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty > 0 else 1.0,
        logit_bias={int(k): float(v) for k, v in params.logit_bias.items()} or None,
        logprobs=min(max(params.top_logprobs, 0), MAX_TOP_LOGPROBS) if params.logprobs else None,
        structured_outputs=structured_outputs(params.constraint) if params.HasField("constraint") else None,
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,  # the gateway owns the text: stop strings, parsers, logprob strings
        skip_special_tokens=False,
    )
