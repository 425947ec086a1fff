"""``loadtest/path_overhead.py``: the live path's time outside the simulated forwards, measured apart.

A fake OpenAI server answers every request's first token after a fixed 0.25 s; the cost file says
a prompt's forward takes 0.1 s + 1 ms a token. What is left over per request is the path overhead
the script must report, and ``sim_vs_live.py --path-overhead-from`` must add.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from loadtest import path_overhead, sim_vs_live
from tests.loadtest.test_sim_vs_live import _write
from tests.loadtest.serve import serving

FIRST_TOKEN_S = 0.25


def fixed_delay_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model", "created": 0, "owned_by": "t"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        words = len(body["messages"][0]["content"].split())

        async def events():
            base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake"}
            await asyncio.sleep(FIRST_TOKEN_S)
            for i in range(body["max_tokens"]):
                yield f"data: {json.dumps(base | {'choices': [{'index': 0, 'delta': {'content': f' w{i}'}}]})}\n\n"
            usage = {"prompt_tokens": words, "completion_tokens": body["max_tokens"], "total_tokens": words + 1,
                     "prompt_tokens_details": {"cached_tokens": 0}}
            yield f"data: {json.dumps(base | {'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
def server_url():
    with serving(fixed_delay_app()) as url:
        yield url


@pytest.mark.slow
def test_overhead_is_live_minus_simulated_and_sim_vs_live_adds_it(server_url: str, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 0, "input_length": 512 * (i + 1), "output_length": 64,
                                         "hash_ids": [10 * i + b for b in range(i + 1)]}) + "\n" for i in range(5)))
    live_rows, costs = _write(tmp_path, [])  # the cost file: prefill 0.1 s + 1 ms a token
    out = tmp_path / "overhead.json"
    assert path_overhead.main(["--url", server_url, "--costs", str(costs), "--mode", "pools", "--trace", str(trace),
                               "--skip", "1", "--requests", "4", "--gap", "0.4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["requests"] == 4 and result["failed"] == 0
    # Prompts of 32..80 words: simulated 0.132..0.180 s against a live ~0.25 s (+ HTTP on loopback).
    assert [r["prompt_tokens"] for r in result["per_request"]] == [32, 48, 64, 80]
    for row in result["per_request"]:
        assert row["simulated_s"] == pytest.approx(0.1 + 0.001 * row["prompt_tokens"], abs=1e-3)
        assert row["difference_s"] == pytest.approx(row["live_s"] - row["simulated_s"])
    expected = FIRST_TOKEN_S - (0.148 + 0.164) / 2  # minus the median simulated TTFT
    assert expected - 0.01 < result["path_overhead_s"] < expected + 0.15  # + loopback HTTP, on a loaded machine

    # sim_vs_live takes it for the same mode, and refuses another mode's.
    rows = [{"index": 0, "arrival_s": 0.0, "ok": True, "status": "", "reason": "", "ttft_s": 0.5, "tbt_s": None,
             "output_tokens": 1, "prompt_tokens": 100, "cached_tokens": 0, "max_tokens": 1, "prompt_words": 90}]
    live_rows.write_text(json.dumps({"per_request": rows}))
    compared = tmp_path / "cmp.json"
    assert sim_vs_live.main(["--live", str(live_rows), "--costs", str(costs), "--mode", "pools",
                             "--path-overhead-from", str(out), "--json", str(compared)]) == 0
    cmp = json.loads(compared.read_text())
    assert cmp["path_overhead_s"] == result["path_overhead_s"]
    assert cmp["simulated"]["p50"] == pytest.approx(0.2 + result["path_overhead_s"])
    assert sim_vs_live.main(["--live", str(live_rows), "--costs", str(costs), "--mode", "aggregated",
                             "--path-overhead-from", str(out)]) == 2


def test_a_trace_too_short_for_the_window_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 512, "output_length": 4, "hash_ids": [1]}) + "\n")
    _, costs = _write(tmp_path, [])
    assert path_overhead.main(["--costs", str(costs), "--mode", "pools", "--trace", str(trace), "--requests", "3"]) == 2
    assert "the trace has 0 requests past --skip 200" in capsys.readouterr().err
