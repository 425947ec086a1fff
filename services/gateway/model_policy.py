"""What a served model accepts and fixes: reasoning controls, sampling defaults, locked parameters.

A model card in the settings (``GatewaySettings.model_policy``; each model family has a default,
``policy_for``) says which ``reasoning_effort`` and ``thinking`` values the model takes (the first
is the default; none: the parameter is refused by name), sampling defaults for every request and
per thinking mode, and *locked* parameters: a request that sets one to another value gets a 400
naming it, as Kimi's API fixes sampling for its thinking models. ``GET /v1/models/{id}`` shows it.

The reasoning effort is ``thinking.effort`` if given, else ``reasoning_effort``, else the card's
default; with thinking disabled both are ignored (the reply does not reason).

``ModelPolicy.apply`` runs first on every chat request: it refuses what the card forbids and
fills in the defaults of the fields the client left unset (pydantic's ``model_fields_set``).
"""

from __future__ import annotations

from typing import Any, Literal

from crescent.services.common.settings import StrictModel
from crescent.services.gateway.api_models import ChatCompletionRequest, ThinkingOption
from crescent.services.gateway.errors import InvalidRequestError
from pydantic import Field, model_validator

# Parameters a card may default or lock (their names in the request).
PolicyParam = Literal["temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty",
                      "repetition_penalty", "n", "max_tokens"]
ThinkingMode = Literal["enabled", "disabled"]


class SamplingPolicy(StrictModel):
    defaults: dict[PolicyParam, float] = Field(default_factory=dict, description="used when a request leaves it unset")
    locked: dict[PolicyParam, float] = Field(
        default_factory=dict, description="a request may leave these unset or set them to exactly this value")

    def merged(self, other: SamplingPolicy) -> SamplingPolicy:
        return SamplingPolicy(defaults={**self.defaults, **other.defaults}, locked={**self.locked, **other.locked})


class ModelPolicy(StrictModel):
    reasoning_efforts: list[str] = Field(default_factory=list, description="accepted values; the first is the default")
    thinking: list[ThinkingMode] = Field(default_factory=list, description="accepted modes; the first is the default")
    thinking_keep: list[str] = Field(default_factory=list, description="accepted values of thinking.keep")
    sampling: SamplingPolicy = SamplingPolicy()
    when_thinking: SamplingPolicy = SamplingPolicy()
    when_not_thinking: SamplingPolicy = SamplingPolicy()

    @model_validator(mode="after")
    def _locks_are_their_own_defaults(self) -> ModelPolicy:
        for name, part in (("sampling", self.sampling), ("when_thinking", self.when_thinking),
                           ("when_not_thinking", self.when_not_thinking)):
            clash = [p for p in part.locked if p in part.defaults and part.defaults[p] != part.locked[p]]
            if clash:
                raise ValueError(f"{name}: {clash[0]} is locked to one value and defaults to another")
        return self

    def thinking_mode(self, request: ChatCompletionRequest) -> ThinkingMode | None:
        """The request's thinking mode (None: the model has no thinking control)."""
        if request.thinking is not None:
            return request.thinking.type
        return self.thinking[0] if self.thinking else None

    def apply(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """``request`` with the card's defaults filled in; ``InvalidRequestError`` for what it forbids."""
        mode = self.thinking_mode(request)
        thinking = request.thinking
        if thinking is not None and thinking.type not in self.thinking:
            allowed = ", ".join(self.thinking) or "none: this model has no thinking control"
            raise InvalidRequestError(f"thinking {thinking.type!r} is not accepted by this model "
                                      f"(accepted: {allowed})", param="thinking.type", code="unsupported_value")
        if thinking is not None and thinking.keep is not None and thinking.keep not in self.thinking_keep:
            allowed = ", ".join(self.thinking_keep) or "none: this model has no thinking.keep control"
            raise InvalidRequestError(f"thinking.keep {thinking.keep!r} is not accepted by this model "
                                      f"(accepted: {allowed})", param="thinking.keep", code="unsupported_value")
        effort = self._effort(request, mode)
        policy = self.sampling.merged(self.when_thinking if mode == "enabled" else
                                      self.when_not_thinking if mode == "disabled" else SamplingPolicy())
        given = request.model_fields_set
        for param, value in policy.locked.items():
            if param in given and float(_value(request, param)) != value:
                raise InvalidRequestError(
                    f"{param} is fixed at {value:g} for this model{_in_mode(mode)}; leave it unset or send {value:g}",
                    param=param, code="locked_parameter")
        update: dict[str, Any] = {}
        for param, value in {**policy.defaults, **policy.locked}.items():
            if param not in given and not (param == "max_tokens" and "max_completion_tokens" in given):
                update[param] = int(value) if param in ("top_k", "n", "max_tokens") else value
        if effort != request.reasoning_effort:
            update["reasoning_effort"] = effort
        if mode is not None:
            keep = thinking.keep if thinking is not None else None
            resolved = ThinkingOption(type=mode, keep=keep, effort=effort if mode == "enabled" else None)
            if resolved != thinking:
                update["thinking"] = resolved
        return request.model_copy(update=update) if update else request

    def _effort(self, request: ChatCompletionRequest, mode: ThinkingMode | None) -> str | None:
        """The request's reasoning effort: ``thinking.effort`` wins over ``reasoning_effort``; None when
        thinking is disabled (both are ignored) or the model has no effort control and none was asked."""
        if mode == "disabled":
            return None
        from_thinking = request.thinking is not None and request.thinking.effort is not None
        effort = request.thinking.effort if from_thinking else request.reasoning_effort  # type: ignore[union-attr]
        if effort is None:
            return self.reasoning_efforts[0] if self.reasoning_efforts else None
        if effort not in self.reasoning_efforts:
            name = "thinking.effort" if from_thinking else "reasoning_effort"
            allowed = ", ".join(self.reasoning_efforts) or "none: this model has no reasoning effort control"
            raise InvalidRequestError(f"{name} {effort!r} is not accepted by this model (accepted: {allowed})",
                                      param=name, code="unsupported_value")
        return effort

    def card(self) -> dict[str, Any]:
        """The policy as ``GET /v1/models/{id}`` shows it."""
        return self.model_dump()


def _value(request: ChatCompletionRequest, param: str) -> float:
    value = getattr(request, param)
    return 0.0 if value is None else value


def _in_mode(mode: ThinkingMode | None) -> str:
    return "" if mode is None else f" with thinking {mode}"


# Kimi K3's API (Moonshot's parameter reference): thinking on by default, effort low/high/max
# (max by default), preserved thinking ("keep": "all"); sampling fixed: temperature 1.0 when
# thinking, 0.6 instant; top_p 0.95, n 1, no presence or frequency penalty.
K3_POLICY = ModelPolicy(
    reasoning_efforts=["max", "low", "high"], thinking=["enabled", "disabled"], thinking_keep=["all"],
    sampling=SamplingPolicy(locked={"n": 1, "top_p": 0.95, "presence_penalty": 0.0, "frequency_penalty": 0.0}),
    when_thinking=SamplingPolicy(locked={"temperature": 1.0}),
    when_not_thinking=SamplingPolicy(locked={"temperature": 0.6}),
)
# Kimi K2 Thinking-style checkpoints: thinking on by default (off: instant), no effort control;
# sampling as its card recommends (temperature 1.0 thinking, 0.6 instant; top_p 0.95 thinking).
K2_POLICY = ModelPolicy(
    thinking=["enabled", "disabled"],
    sampling=SamplingPolicy(locked={"n": 1}),
    when_thinking=SamplingPolicy(defaults={"temperature": 1.0}, locked={"top_p": 0.95}),
    when_not_thinking=SamplingPolicy(defaults={"temperature": 0.6}),
)
NO_POLICY = ModelPolicy()
# By config.json model_type. Kimi-Linear-Instruct is not a thinking model: no thinking control.
FAMILY_POLICIES: dict[str, ModelPolicy] = {"kimi_k3": K3_POLICY, "kimi_k2": K2_POLICY, "deepseek_v3": K2_POLICY}


def policy_for(model_type: str | None) -> ModelPolicy:
    """The default card of a model family (``FAMILY_POLICIES``); none for families not listed."""
    return FAMILY_POLICIES.get(model_type or "", NO_POLICY)
