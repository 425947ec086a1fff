"""Tokenizer for Llama-family models, built on the ``tokenizers`` library.

From a GGUF file it rebuilds the byte-level BPE (vocabulary, merges, pre-tokenizer, control
tokens) from metadata alone, without touching the weights, so the gateway can use it cheaply.
From a Hugging Face directory it loads ``tokenizer.json`` and ``tokenizer_config.json``.
``encode`` never adds BOS: chat templates such as ChatML already start with their own marker.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HfTokenizer

from crescent.services.model.chat_template import ChatTemplate
from crescent.services.model.literal_text import control_text_pattern
from crescent.services.model.model_source import ModelSource

logger = logging.getLogger(__name__)

# Tokens that end a turn or a document in common vocabularies; generation stops on them.
END_MARKERS = frozenset(
    {"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "<|end|>",
     "</s>", "<end_of_turn>"}
)

# llama.cpp token types (gguf.TokenType): 3 = control (special), 4 = user-defined.
_CONTROL, _USER_DEFINED = int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # StarCoder-style vocabularies (SmolLM's included) split every digit on its own first.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split_then_bytes(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    return lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# GGUF ``tokenizer.ggml.pre`` → the equivalent Hugging Face pre-tokenizer (same regexes as llama.cpp).
PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _gpt2, "gpt2": _gpt2, "mpt": _gpt2, "olmo": _gpt2,
    "smollm": _digits_then_gpt2, "starcoder": _digits_then_gpt2, "refact": _digits_then_gpt2,
    "llama-bpe": _split_then_bytes(_LLAMA3_SPLIT), "llama3": _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": _split_then_bytes(_QWEN2_SPLIT),
}


class TokenizerError(ValueError):
    """A tokenizer that cannot be built from the given files; the message says which part."""


class IncrementalDetokenizer:
    """Turns a stream of token ids into text, emitting only whole characters."""

    __slots__ = ("_tokenizer", "_stream")

    def __init__(self, tokenizer: HfTokenizer) -> None:
        self._tokenizer = tokenizer
        self._stream = decoders.DecodeStream(skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (often ``""`` mid-character)."""
        return self._stream.step(self._tokenizer, int(token_id)) or ""


class Tokenizer:
    """Encode/decode, stop tokens and chat template of one model."""

    __slots__ = ("_tok", "_eos_ids", "_bos_id", "_bos_text", "_eos_text", "_template", "_control", "_as_text",
                 "_added_text")

    def __init__(self, tok: HfTokenizer, *, eos_token_ids: Sequence[int], bos_token_id: int | None,
                 chat_template: str | None) -> None:
        self._tok = tok
        self._eos_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        if not self._eos_ids:
            raise TokenizerError("tokenizer defines no end-of-sequence token")
        self._bos_id = bos_token_id
        self._bos_text = None if bos_token_id is None else tok.id_to_token(bos_token_id)
        self._eos_text = tok.id_to_token(self._eos_ids[0])
        self._template = ChatTemplate(chat_template, bos_token=self._bos_text, eos_token=self._eos_text)
        self._control = control_text_pattern(a.content for a in tok.get_added_tokens_decoder().values() if a.special)
        self._as_text: HfTokenizer | None = None  # a copy that encodes control-token text as text, made on first use
        self._added_text = {i: a.content for i, a in tok.get_added_tokens_decoder().items()}

    # --- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build from a GGUF file's metadata (the tensors are not read)."""
        try:
            reader = gguf.GGUFReader(str(path))
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"cannot read GGUF file {path}: {exc}") from exc
        return cls.from_gguf_reader(reader)

    @classmethod
    def from_gguf_reader(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Build from an already parsed GGUF file (parsing takes seconds: do it once)."""
        def meta(key: str, default: Any = None) -> Any:
            field = reader.fields.get(key)
            return default if field is None else field.contents()

        kind = meta("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(f"GGUF tokenizer.ggml.model {kind!r} is not supported (only 'gpt2' BPE)")
        pre = meta("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise TokenizerError(
                f"GGUF tokenizer.ggml.pre {pre!r} is not supported; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
            )
        tokens: list[str] = meta("tokenizer.ggml.tokens") or []
        merges: list[str] = meta("tokenizer.ggml.merges") or []
        types: list[int] = meta("tokenizer.ggml.token_type") or [1] * len(tokens)
        if not tokens or not merges:
            raise TokenizerError("GGUF file lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")

        pairs = [_merge_pair(m) for m in merges]
        try:
            bpe = models.BPE(
                vocab={t: i for i, t in enumerate(tokens)},
                merges=pairs,
                fuse_unk=False,
                ignore_merges=pre in ("llama-bpe", "llama3"),
            )
        except Exception as exc:  # the library raises a bare Exception, e.g. for a merge of unknown tokens
            raise TokenizerError(f"GGUF vocabulary and merges are inconsistent: {exc}") from exc
        tok = HfTokenizer(bpe)
        tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        added = [AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
                 for i in range(len(tokens)) if types[i] in (_CONTROL, _USER_DEFINED)]
        tok.add_tokens([a for a in added if not a.special])
        tok.add_special_tokens([a for a in added if a.special])

        eos = [meta(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        control = {tokens[i]: i for i in range(len(tokens)) if types[i] == _CONTROL}
        eos_ids = [i for i in eos if i is not None] + sorted(control[t] for t in END_MARKERS & control.keys())
        return cls(tok, eos_token_ids=eos_ids, bos_token_id=meta("tokenizer.ggml.bos_token_id"),
                   chat_template=meta("tokenizer.chat_template"))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``config.json``) from a directory."""
        path = Path(path)
        try:
            tok = HfTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # the library raises a bare Exception on bad files
            raise TokenizerError(f"cannot read {path / 'tokenizer.json'}: {exc}") from exc
        tcfg = _read_json(path / "tokenizer_config.json")
        mcfg = _read_json(path / "config.json")
        gcfg = _read_json(path / "generation_config.json")

        def token_id(value: Any) -> int | None:
            text = value.get("content") if isinstance(value, Mapping) else value
            return tok.token_to_id(text) if isinstance(text, str) else None

        eos_ids: list[int] = []
        for cfg in (gcfg, mcfg):
            eos = cfg.get("eos_token_id")
            eos_ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if (tid := token_id(tcfg.get("eos_token"))) is not None:
            eos_ids.append(tid)
        specials = {a.content: i for i, a in tok.get_added_tokens_decoder().items() if a.special}
        eos_ids += sorted(specials[t] for t in END_MARKERS & specials.keys())
        bos = mcfg.get("bos_token_id")
        if bos is None:
            bos = token_id(tcfg.get("bos_token"))
        return cls(tok, eos_token_ids=eos_ids, bos_token_id=bos, chat_template=checkpoint_chat_template(path, tcfg))

    @classmethod
    def for_model(cls, source: ModelSource) -> Tokenizer:
        if source.kind == "gguf":
            return cls.from_gguf(source.path)
        return cls.from_hf_dir(source.path)

    # --- use ------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def chat_template(self) -> str:
        return self._template.source

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token text such as ``<|im_start|>`` maps to its id."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def hf_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what grammar engines build their token trie from)."""
        return self._tok.to_str()

    def contains_control_text(self, text: str) -> bool:
        """Whether ``text`` holds the string of a control (special) token."""
        return self._control is not None and self._control.search(text) is not None

    def encode_as_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with control-token strings encoded as the plain text they are."""
        if self._as_text is None:
            # A copy, not a flag flipped on the shared tokenizer: prompts are encoded on several threads.
            copy = HfTokenizer.from_str(self._tok.to_str())
            copy.encode_special_tokens = True
            self._as_text = copy
        return self._as_text.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (what logprobs report): an added token's text, else its
        vocabulary entry spelled back into bytes (byte-level BPE, or SentencePiece's ``<0xNN>``/``▁``)."""
        if token_id in self._added_text:
            return self._added_text[token_id].encode("utf-8")
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            raise TokenizerError(f"token id {token_id} is not in the vocabulary")
        if isinstance(self._tok.decoder, decoders.ByteLevel) and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **template_vars: Any) -> str:
        """Render a conversation; ``template_vars`` (``chat_template_kwargs``, thinking...) go to the template."""
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, **template_vars)

    def new_detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._tok)

    def save_hf(self, out_dir: Path, *, model_max_length: int | None = None) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` as transformers expects them."""
        self._tok.save(str(out_dir / "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": False,
            "add_eos_token": False,
            "bos_token": self._bos_text,
            "eos_token": self._eos_text,
            "pad_token": self._eos_text,
            "clean_up_tokenization_spaces": False,
            "chat_template": self._template.source,
        }
        if model_max_length is not None:
            config["model_max_length"] = model_max_length
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character table reversed: how byte-level BPE vocabularies spell each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = dict(zip(printable, printable))
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + sum(1 for x in range(b) if x not in printable)
    return {chr(c): b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()


def _merge_pair(merge: str) -> tuple[str, str]:
    # Byte-level tokens never contain a literal space (it is "Ġ"), so the first space separates.
    left, sep, right = merge.partition(" ")
    if not sep:
        raise TokenizerError(f"GGUF merge {merge!r} is not two tokens separated by a space")
    return left, right


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} is not a JSON object")
    return data


def checkpoint_chat_template(path: Path, tcfg: Mapping[str, Any]) -> str | None:
    """The chat template a model directory ships: ``chat_template.jinja``, else ``tokenizer_config.json``'s."""
    if (path / "chat_template.jinja").is_file():  # newer transformers save it beside the config
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None
