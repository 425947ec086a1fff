"""Load what the gateway needs of a model: its tokenizer, chat template, id and context window.

Never the weights: the gateway reads the GGUF metadata (or a Hugging Face directory's JSON
files) only, so it starts in seconds and uses little memory.
"""

from __future__ import annotations

import logging

import gguf
from crescent.services.model.chat_template import ChatTemplateError, template_takes_tools
from crescent.services.model.hf_config import dir_context_window
from crescent.services.model.kimi_tokenizer import KimiTokenizer, model_type_of, tokenizer_for
from crescent.services.model.model_source import ModelSource, resolve_model
from crescent.services.model.tokenizer import Tokenizer
from crescent.services.gateway.config import DEFAULT_CONTEXT_WINDOW, GatewaySettings
from crescent.services.gateway.model_policy import NO_POLICY, ModelPolicy, policy_for
from crescent.services.gateway.parsing.output_format import (
    DEFAULT_TOOL_OUTPUT,
    K3_OUTPUT,
    KIMI_OUTPUT,
    PLAIN_OUTPUT,
    OutputFormat,
)
from crescent.services.gateway.prompt import ChatTokenizer, ServedModel

log = logging.getLogger(__name__)


def _gguf_tokenizer_and_window(source: ModelSource) -> tuple[Tokenizer, int | None]:
    reader = gguf.GGUFReader(str(source.path))  # parsing takes seconds: do it once for both

    def meta(key: str) -> object:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    arch = meta("general.architecture")
    window = meta(f"{arch}.context_length") if isinstance(arch, str) else None
    return Tokenizer.from_gguf_reader(reader), None if window is None else int(window)  # type: ignore[call-overload]


def _hf_tokenizer_and_window(source: ModelSource) -> tuple[ChatTokenizer, int | None]:
    # the engine's window: the length keys vLLM reads, text_config's included (hf_config); a seeded
    # preset has no files: the default window applies (the nano preset's own)
    window = dir_context_window(source.path) if source.random_seed is None else None
    return tokenizer_for(source), window  # Kimi's tokenizer for Kimi models


def _output_format(tokenizer: ChatTokenizer, model_id: str) -> OutputFormat:
    """Kimi K3 writes XTML channels; other Kimi models reason in <think> tags and call tools in
    K2's markup (the parsers follow the model's format, whichever template renders the prompt);
    a template without tool support gets the gateway's default tool prompt (``default_tools``).
    A template with a tool format of its own is not one the gateway can parse yet: its model
    serves plain text."""
    if isinstance(tokenizer, KimiTokenizer):
        return K3_OUTPUT if tokenizer.chat_format == "k3" else KIMI_OUTPUT
    if isinstance(tokenizer, Tokenizer) and template_takes_tools(tokenizer.chat_template):
        log.warning("model %s: its chat template has its own tool format, which the gateway does not parse; "
                    "requests with tools are refused", model_id)
        return PLAIN_OUTPUT
    return DEFAULT_TOOL_OUTPUT


def _policy(source: ModelSource, tokenizer: ChatTokenizer) -> ModelPolicy:
    """The card follows the model (config.json's model_type), not the tokenizer: Kimi-Linear shares
    Kimi's tokenizer but is no thinking model. A ``deepseek_v3`` checkpoint is Kimi K2 only with
    Kimi's tokenizer (DeepSeek-V3 itself is not). settings.model_policy replaces it (server.main)."""
    if source.kind == "gguf":
        return NO_POLICY
    model_type = model_type_of(source)
    if model_type == "deepseek_v3" and not isinstance(tokenizer, KimiTokenizer):
        return NO_POLICY
    return policy_for(model_type)


def load_served_model(settings: GatewaySettings) -> ServedModel:
    """Resolve ``settings.model``; raises ``model_source.ModelSpecError`` for an unknown spec."""
    source = resolve_model(settings.model)
    tokenizer: ChatTokenizer
    if source.kind == "gguf":
        tokenizer, model_window = _gguf_tokenizer_and_window(source)
    else:
        tokenizer, model_window = _hf_tokenizer_and_window(source)
    window = settings.context_window or model_window or DEFAULT_CONTEXT_WINDOW
    log.info("model %s (%s): context window %d tokens", source.model_id, source.path, window)
    policy = _policy(source, tokenizer)
    return ServedModel(
        tokenizer=tokenizer, model_id=source.model_id, context_window=window, template_errors=(ChatTemplateError,),
        output_format=_output_format(tokenizer, source.model_id), policy=policy,
    )
