"""Tokenizer and chat format of Moonshot's Kimi models, built on ``tiktoken``.

A Kimi tokenizer directory holds ``tiktoken.model`` (one base64 token and its rank per line)
and ``tokenizer_config.json`` (the special tokens and their ids). ``KimiTokenizer`` offers the
same interface as ``crescent.services.model.tokenizer.Tokenizer`` plus tool definitions in
``apply_chat_template``.

The pre-tokenizer regex is the ``pat_str`` of Kimi K2's ``tokenization_kimi.py``
(Han runs; letter runs with optional English contractions, split at case changes; digits in
groups of up to three; punctuation; newlines; whitespace). Like Kimi's own tokenizer, very long
runs of whitespace or non-whitespace are cut before the regex runs, which keeps encoding linear.

Which chat format a tokenizer renders is chosen by the model, not the vocabulary:

- a checkpoint that ships its own template (``chat_template.jinja`` or ``tokenizer_config.json``'s
  ``chat_template``) is rendered with it, in jinja2's sandbox as transformers does;
- otherwise Kimi K3 checkpoints (``model_type: kimi_k3``) use K3's XTML format
  (``kimi_k3_format``; K3 ships no Jinja template), and every other Kimi model Kimi K2's.

K3's tokenizer_config.json names ids 163586-163589 ``<|end_of_msg|>``, ``<|open|>``,
``<|close|>``, ``<|sep|>`` where K2's has ``<|im_end|>``, ``<|im_user|>``, ``<|im_assistant|>``
and a reserved id; a K3 model read with a K2 vocabulary directory (a preset with random weights)
gets K3's names for them (``K3_SPECIAL_TOKENS``).

Kimi K2's format is ``kimi_k2_format``'s, K3's ``kimi_k3_format``'s.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import json
import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import tiktoken
from crescent.services.model.chat_template import ChatTemplate
from crescent.services.model.kimi_k2_format import END_OF_TURN, KIMI_CHAT_TEMPLATE
from crescent.services.model.kimi_k3_format import DEFAULT_THINKING_EFFORT, END_OF_MSG, K3_SPECIAL_TOKENS, render_k3_chat
from crescent.services.model.literal_text import OPEN as LITERAL_OPEN
from crescent.services.model.literal_text import control_text_pattern, encode_marked
from crescent.services.model.model_source import ModelSource
from crescent.services.model.tokenizer import Tokenizer, TokenizerError, checkpoint_chat_template

logger = logging.getLogger(__name__)

VOCAB_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
# Where the Kimi vocabulary lives when a model directory does not ship one (e.g. a preset with
# random weights): this environment variable, else ``../shared/kimi-tokenizer`` beside the repo.
TOKENIZER_DIR_ENV = "CRESCENT_KIMI_TOKENIZER_DIR"
NUM_RESERVED_SPECIAL = 256  # ids [len(ranks), len(ranks) + 256) are special; unnamed ones are reserved

PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
_MAX_RUN = 25_000  # longest run of (non-)whitespace handed to the regex in one piece
_RUNS = re.compile(r"\s+|\S+")

# Which earlier assistant turns keep their reasoning in the prompt, by config.json model_type.
ThinkingHistory = Literal["all", "current_turn"]
THINKING_HISTORY: dict[str, ThinkingHistory] = {
    "kimi_k3": "all",  # preserved thinking: K3 was trained with it and is unstable without it
    "kimi_linear": "current_turn",
    "kimi_k2": "current_turn",
    "deepseek_v3": "current_turn",  # Kimi K2 checkpoints declare DeepSeek-V3's architecture
}
DEFAULT_THINKING_HISTORY: ThinkingHistory = "current_turn"  # Kimi K2 Thinking's published behaviour
# Which built-in chat format a model family uses when its checkpoint ships no template.
ChatFormat = Literal["k2", "k3"]
CHAT_FORMATS: dict[str, ChatFormat] = {"kimi_k3": "k3"}
_REQUIRED_SPECIALS: dict[ChatFormat, tuple[str, ...]] = {
    "k2": ("[BOS]", "[EOS]", "<|im_end|>", "<|im_middle|>"),
    "k3": ("[BOS]", "[EOS]", END_OF_MSG, "<|open|>", "<|close|>", "<|sep|>"),
}

END_OF_TEXT = "[EOS]"


class KimiDetokenizer:
    """Turns a stream of token ids into text, emitting only whole UTF-8 characters."""

    __slots__ = ("_encoding", "_skip", "_utf8")

    def __init__(self, encoding: tiktoken.Encoding, skip: frozenset[int]) -> None:
        self._encoding = encoding
        self._skip = skip
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (often ``""`` mid-character)."""
        if token_id in self._skip:
            return ""
        return self._utf8.decode(_token_bytes(self._encoding, token_id))


class KimiTokenizer:
    """Encode/decode, stop tokens and chat format of a Kimi model (see the module docstring)."""

    __slots__ = ("_enc", "_special_ids", "_skip_ids", "_template", "_control", "thinking_history", "chat_format")

    def __init__(self, mergeable_ranks: dict[bytes, int], special_tokens: Mapping[str, int], *,
                 skip_ids: frozenset[int], thinking_history: ThinkingHistory = DEFAULT_THINKING_HISTORY,
                 chat_format: ChatFormat = "k2", template: str | None = None) -> None:
        """``skip_ids``: the special tokens ``decode(skip_special_tokens=True)`` and the detokenizer drop;
        ``thinking_history``: which earlier assistant turns keep their reasoning (module docstring);
        ``chat_format``: the model's format (its stop token; its built-in template);
        ``template``: the checkpoint's own Jinja template, which replaces the built-in one."""
        if thinking_history not in ("all", "current_turn"):
            raise TokenizerError(f"thinking_history must be 'all' or 'current_turn', got {thinking_history!r}")
        self.thinking_history = thinking_history
        self.chat_format = chat_format
        for name in _REQUIRED_SPECIALS[chat_format]:
            if name not in special_tokens:
                raise TokenizerError(f"Kimi special token {name} is missing from {CONFIG_FILE}")
        self._enc = tiktoken.Encoding(
            "kimi", pat_str=PAT_STR, mergeable_ranks=mergeable_ranks, special_tokens=dict(special_tokens)
        )
        self._special_ids = dict(special_tokens)
        self._skip_ids = skip_ids
        source = template if template is not None else KIMI_CHAT_TEMPLATE if chat_format == "k2" else None
        self._template = None if source is None else ChatTemplate(source, bos_token="[BOS]", eos_token=END_OF_TEXT)
        self._control = control_text_pattern(special_tokens)

    # --- construction -------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path, *, thinking_history: ThinkingHistory = DEFAULT_THINKING_HISTORY,
                 chat_format: ChatFormat = "k2", template_dir: Path | None = None) -> KimiTokenizer:
        """Load ``tiktoken.model`` and ``tokenizer_config.json`` from a directory; the chat template
        from ``template_dir`` (the checkpoint's directory) if it ships one, else from ``path``."""
        path = Path(path)
        ranks = _read_ranks(path / VOCAB_FILE)
        config = _read_config(path / CONFIG_FILE)
        template = checkpoint_template(template_dir) if template_dir is not None else None
        template = template if template is not None else checkpoint_template(path, config)
        table = config.get("added_tokens_decoder")
        if not isinstance(table, Mapping):
            raise TokenizerError(f"{path / CONFIG_FILE} has no added_tokens_decoder table")
        named: dict[int, tuple[str, bool]] = {}
        for key, entry in table.items():
            if not (isinstance(entry, Mapping) and isinstance(entry.get("content"), str) and str(key).isdigit()):
                raise TokenizerError(f"{path / CONFIG_FILE}: bad added_tokens_decoder entry {key!r}")
            named[int(key)] = (entry["content"], bool(entry.get("special", True)))
        if chat_format == "k3" and "<|open|>" not in {text for text, _ in named.values()}:
            logger.info("%s has K2's special tokens: using K3's names for ids %s", path, sorted(K3_SPECIAL_TOKENS))
            named.update(K3_SPECIAL_TOKENS)
        first = len(ranks)
        specials: dict[str, int] = {}
        skip: set[int] = set()
        for token_id in range(first, first + NUM_RESERVED_SPECIAL):
            text, special = named.pop(token_id, (f"<|reserved_token_{token_id}|>", True))
            specials[text] = token_id
            if special:
                skip.add(token_id)  # dropped by decode(skip_special_tokens=True); <think> and tool markers are kept
        if named:
            raise TokenizerError(
                f"{path / CONFIG_FILE}: special token ids {sorted(named)} lie outside [{first}, "
                f"{first + NUM_RESERVED_SPECIAL})"
            )
        tok = cls(ranks, specials, skip_ids=frozenset(skip), thinking_history=thinking_history,
                  chat_format=chat_format, template=template)
        logger.info("Kimi tokenizer from %s: %d tokens, %s format, %s template, thinking history %s", path,
                    tok.vocab_size, chat_format, "the checkpoint's" if template is not None else "the built-in",
                    thinking_history)
        return tok

    # --- use ------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        # The end of a turn first (<|im_end|>, K3's <|end_of_msg|>); [EOS] ends a document.
        end_of_turn = END_OF_MSG if self.chat_format == "k3" else END_OF_TURN
        return (self._special_ids[end_of_turn], self._special_ids[END_OF_TEXT])

    @property
    def bos_token_id(self) -> int | None:
        return self._special_ids["[BOS]"]

    @property
    def chat_template(self) -> str | None:
        """The Jinja source rendered (None: K3's built-in format, rendered in Python)."""
        return None if self._template is None else self._template.source

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token text such as ``<|im_end|>`` maps to its id. A prompt
        whose text segments are marked literal (K3's format) is encoded segment by segment."""
        if LITERAL_OPEN in text:
            return encode_marked(text, self._encode, self.encode_as_text)
        return self._encode(text)

    def _encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _pieces(text):
            ids += self._enc.encode(piece, allowed_special="all")
        return ids

    @property
    def encoding(self) -> tiktoken.Encoding:
        """The tiktoken encoding (what grammar engines build their token trie from)."""
        return self._enc

    def contains_control_text(self, text: str) -> bool:
        """Whether ``text`` holds the string of one of Kimi's special tokens."""
        return self._control is not None and self._control.search(text) is not None

    def encode_as_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with special-token strings encoded as the plain text they are."""
        ids: list[int] = []
        for piece in _pieces(text):
            ids += self._enc.encode(piece, allowed_special=set(), disallowed_special=())
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        kept = [i for i in ids if not (skip_special_tokens and i in self._skip_ids)]
        return b"".join(_token_bytes(self._enc, i) for i in kept).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (what logprobs report); a special token's are its text."""
        return _token_bytes(self._enc, token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a special token's text, or of a text that is exactly one ordinary token."""
        if token in self._special_ids:
            return self._special_ids[token]
        try:
            return self._enc.encode_single_token(token.encode("utf-8"))
        except KeyError:
            return None

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **template_vars: Any) -> str:
        """Render a conversation; ``tools`` are OpenAI tool definitions (``{"type": "function", ...}``);
        ``template_vars`` go to the template (``thinking=False`` opens the reply with an empty think block;
        ``preserve_thinking`` overrides the family's thinking history for this conversation). K3's
        built-in format reads ``thinking`` (default on), ``thinking_effort`` (default max, as K3's
        own encoder), ``tool_choice`` and ``response_format``."""
        if self._template is None:
            thinking = template_vars.get("thinking", True) is not False
            return render_k3_chat(messages, tools or None, add_generation_prompt=add_generation_prompt,
                                  thinking=thinking,
                                  thinking_effort=template_vars.get("thinking_effort") or DEFAULT_THINKING_EFFORT,
                                  tool_choice=template_vars.get("tool_choice"),
                                  response_format=template_vars.get("response_format"))
        template_vars.setdefault("preserve_thinking", self.thinking_history == "all")
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools or None,
                                     **template_vars)

    def new_detokenizer(self) -> KimiDetokenizer:
        return KimiDetokenizer(self._enc, self._skip_ids)


def _token_bytes(encoding: tiktoken.Encoding, token_id: int) -> bytes:
    try:
        return encoding.decode_single_token_bytes(int(token_id))
    except KeyError as exc:
        raise TokenizerError(f"token id {token_id} is not in the vocabulary") from exc


def _pieces(text: str) -> Iterator[str]:
    """``text`` cut between runs longer than ``_MAX_RUN`` characters (whole text if none is)."""
    start = 0
    for run in _RUNS.finditer(text):
        if run.end() - run.start() <= _MAX_RUN:
            continue
        for cut in range(run.start() + _MAX_RUN, run.end(), _MAX_RUN):
            yield text[start:cut]
            start = cut
    yield text[start:]


def _read_ranks(path: Path) -> dict[bytes, int]:
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    ranks: dict[bytes, int] = {}
    try:
        for line in lines:
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (ValueError, binascii.Error) as exc:
        raise TokenizerError(f"{path} is not a tiktoken vocabulary (base64 token and rank per line): {exc}") from exc
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks are not 0..{len(ranks) - 1} without gaps or repeats")
    return ranks


def checkpoint_template(directory: Path, config: Mapping[str, Any] | None = None) -> str | None:
    """The chat template a checkpoint ships (``tokenizer.checkpoint_chat_template``): its
    ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``."""
    if config is None:
        config_path = directory / CONFIG_FILE
        config = _read_config(config_path) if config_path.is_file() else {}
    return checkpoint_chat_template(directory, config)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} is not a JSON object")
    return data


# --- choosing a tokenizer for a model ------------------------------------------------------


def default_tokenizer_dir() -> Path:
    """``$CRESCENT_KIMI_TOKENIZER_DIR``, else ``../shared/kimi-tokenizer`` beside the repository."""
    configured = os.environ.get(TOKENIZER_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path(__file__).resolve().parents[2].parent / "shared" / "kimi-tokenizer"


def thinking_history_for(model_type: str | None) -> ThinkingHistory:
    """The thinking history of a model family (``THINKING_HISTORY``), K2-style for families not listed."""
    return THINKING_HISTORY.get(model_type or "", DEFAULT_THINKING_HISTORY)


def model_type_of(source: ModelSource) -> str | None:
    """config.json's ``model_type``; a seeded preset has no files, its kind is its family."""
    if source.random_seed is not None:
        return source.kind
    try:
        raw = json.loads((source.path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw.get("model_type") if isinstance(raw, dict) else None


def chat_format_for(model_type: str | None) -> ChatFormat:
    """The built-in chat format of a model family (``CHAT_FORMATS``), K2's for families not listed."""
    return CHAT_FORMATS.get(model_type or "", "k2")


def load_kimi_tokenizer(model_dir: Path | None = None, *,
                        thinking_history: ThinkingHistory = DEFAULT_THINKING_HISTORY,
                        chat_format: ChatFormat = "k2") -> KimiTokenizer:
    """The Kimi tokenizer of ``model_dir`` if it ships one, else the one in ``default_tokenizer_dir()``
    (with ``model_dir``'s own chat template, if it ships one)."""
    if model_dir is not None and (model_dir / VOCAB_FILE).is_file():
        return KimiTokenizer.from_dir(model_dir, thinking_history=thinking_history, chat_format=chat_format)
    fallback = default_tokenizer_dir()
    if not (fallback / VOCAB_FILE).is_file():
        raise TokenizerError(
            f"the Kimi vocabulary ({VOCAB_FILE} + {CONFIG_FILE}) is not in "
            f"{model_dir or 'the model directory'} nor in {fallback}; set {TOKENIZER_DIR_ENV} to its directory"
        )
    return KimiTokenizer.from_dir(fallback, thinking_history=thinking_history, chat_format=chat_format,
                                  template_dir=model_dir)


def tokenizer_for(source: ModelSource) -> Tokenizer | KimiTokenizer:
    """The tokenizer of a resolved model: Kimi's where the source says so (``tokenizer="kimi"``) or
    where its directory ships ``tiktoken.model`` without ``tokenizer.json``; else ``Tokenizer.for_model``.
    A Kimi tokenizer keeps the thinking history of the model's family (``thinking_history_for``)."""
    model_dir = source.path if source.kind != "gguf" and source.random_seed is None and source.path.is_dir() else None
    model_type = model_type_of(source) if source.kind != "gguf" else None
    history = thinking_history_for(model_type) if source.kind != "gguf" else DEFAULT_THINKING_HISTORY
    fmt = chat_format_for(model_type)
    if source.tokenizer == "kimi":
        return load_kimi_tokenizer(model_dir, thinking_history=history, chat_format=fmt)
    if model_dir is not None and (model_dir / VOCAB_FILE).is_file() and not (model_dir / "tokenizer.json").is_file():
        return KimiTokenizer.from_dir(model_dir, thinking_history=history, chat_format=fmt)
    return Tokenizer.for_model(source)
