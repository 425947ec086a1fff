"""loadtest/replay.py: the pure parts (block text, scaling, TBT, the trace's cache bound) and one
replay against a tiny fake OpenAI-compatible streaming server on loopback."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from loadtest.replay import (
    ReplayConfig,
    block_text,
    build_prompt,
    parse_reason,
    percentile,
    plot_sweep,
    replay,
    scaled_input_words,
    scaled_output,
    theoretical_cached_fraction,
    time_scale_for_rate,
)
from crescent.services.contract.latency import tbt_seconds as mooncake_tbt
from loadtest.simulator.trace import TraceRequest, load_trace, rescale
from tests.loadtest.serve import serving


def req(i, arrival, inp, out, ids):
    return TraceRequest(index=i, arrival_s=arrival, input_length=inp, output_length=out, hash_ids=tuple(ids))


def test_block_text_is_deterministic_and_distinct():
    assert block_text(7, 16) == block_text(7, 16)
    assert len(block_text(7, 16).split()) == 16
    assert block_text(7, 16) != block_text(8, 16)
    assert block_text(7, 16, seed=1) != block_text(7, 16, seed=0)


def test_prompts_share_prefixes_exactly_as_the_trace():
    a = build_prompt(req(0, 0, 3 * 512, 1, [1, 2, 3]), 16)
    b = build_prompt(req(1, 0, 3 * 512, 1, [1, 2, 4]), 16)
    wa, wb = a.split(), b.split()
    assert len(wa) == len(wb) == 48
    assert wa[:32] == wb[:32] and wa[32:] != wb[32:]
    assert a[: len(" ".join(wa[:32]))] == b[: len(" ".join(wb[:32]))]


def test_scaling():
    r = req(0, 0, 1000, 100, [1, 2])  # 1000 tokens = 1.95 blocks -> 32 words, last block trimmed
    assert scaled_input_words(r, 16) == 32
    assert len(build_prompt(req(0, 0, 600, 1, [1, 2]), 16).split()) == 19  # ceil(600*16/512)
    assert scaled_output(r, 32) == 3 and scaled_output(req(0, 0, 1, 1, [1]), 32) == 1
    trace = [req(i, i * 2.0, 512, 1, [i]) for i in range(5)]  # 0.5 req/s
    assert time_scale_for_rate(trace, 2.0) == pytest.approx(0.25)
    assert [r.arrival_s for r in rescale(trace, 0.25)] == [0, 0.5, 1.0, 1.5, 2.0]


def test_tbt_is_the_mean_of_the_longest_tenth():
    assert mooncake_tbt([0.1] * 9 + [1.0]) == pytest.approx(1.0)
    assert mooncake_tbt([0.1] * 18 + [1.0, 0.5]) == pytest.approx(0.75)
    assert mooncake_tbt([0.2, 0.4]) == pytest.approx(0.4)
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([], 90) is None


def test_theoretical_cached_fraction():
    trace = [req(0, 0, 1024, 1, [1, 2]), req(1, 0, 1536, 1, [1, 2, 3]), req(2, 0, 768, 1, [1, 9])]
    th = theoretical_cached_fraction(trace, 16)
    assert th["blocks"] == pytest.approx(3 / 7)  # ids 1,2 in the 2nd; 1 in the 3rd
    assert th["tokens"] == pytest.approx(48 / (32 + 48 + 24))  # the 3rd's last block has 8 words


def test_parse_reason():
    assert parse_reason("rejected by the scheduler (ttft_slo): predicted 12 s") == "ttft_slo"
    assert parse_reason("Error code: 429 - {'message': 'rejected by the scheduler (decode_kv_full)'}") == "decode_kv_full"
    assert parse_reason("overloaded") == "other"


# ---------------------------------------------------------------- a fake server
FIRST_DELAY, GAP, SLOW_FIRST = 0.02, 0.03, 0.8


def fake_app(seen: list):
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model", "created": 0, "owned_by": "t"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append(body)
        n = body["max_tokens"]
        if n == 1:  # the trace's rejected request
            msg = "rejected by the scheduler (ttft_slo): predicted TTFT 99 s"
            return JSONResponse({"error": {"message": msg, "type": "rate_limit", "param": None, "code": 429}}, 429)
        prompt = len(body["messages"][0]["content"].split())

        async def events():
            base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake"}
            await asyncio.sleep(SLOW_FIRST if n == 5 else FIRST_DELAY)
            for i in range(n):
                if i:
                    await asyncio.sleep(GAP)
                text = "" if n == 6 else f" w{i}"  # 6: tokens that detokenize to nothing
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
                yield f"data: {json.dumps(base | {'choices': [choice]})}\n\n"
            usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                     "prompt_tokens_details": {"cached_tokens": prompt // 2}}
            yield f"data: {json.dumps(base | {'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
def fake_server():
    seen: list = []
    with serving(fake_app(seen)) as url:
        yield url, seen


@pytest.mark.slow
def test_replay_against_a_fake_server(fake_server, tmp_path):
    url, seen = fake_server
    rows = [  # outputs 4, 5 (slow first token), 1 (rejected), 3
        {"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]},
        {"timestamp": 400, "input_length": 1024, "output_length": 5, "hash_ids": [1, 3]},
        {"timestamp": 800, "input_length": 512, "output_length": 1, "hash_ids": [4]},
        {"timestamp": 1200, "input_length": 1536, "output_length": 3, "hash_ids": [1, 2, 5]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = load_trace(path)
    cfg = ReplayConfig(url=url, tokens_per_block=16, output_scale=1, time_scale=0.25, max_seconds=30,
                       ttft_slo=0.5, tbt_slo=0.5)
    t0 = time.monotonic()
    report = asyncio.run(replay(cfg, trace))
    assert time.monotonic() - t0 < 10
    assert report["model"] == "fake"
    assert [b["max_tokens"] for b in seen] == [4, 5, 1, 3], report
    assert all(b["ignore_eos"] is True for b in seen)
    assert seen[0]["stream_options"] == {"include_usage": True} and seen[0]["temperature"] == 0
    assert report["requests"] == 4 and report["completed"] == 3 and report["failed"] == 1
    assert report["rejections"] == {"429 ttft_slo": 1}
    assert report["offered_rps"] == pytest.approx(3 / 0.3)
    assert report["output_tokens"] == 12 and report["prompt_tokens"] == 32 + 32 + 48
    assert report["cached_fraction"] == pytest.approx((16 + 16 + 24) / 112)
    assert report["theoretical_cached_fraction"]["blocks"] == pytest.approx(3 / 8)
    ttft = report["ttft_s"]
    assert FIRST_DELAY <= ttft["p50"] < SLOW_FIRST and ttft["p99"] > 0.9 * SLOW_FIRST  # p99 of 3 interpolates below the max
    assert GAP * 0.8 <= report["tbt_s"]["p50"] < 0.3
    # TTFT SLO 0.5 s: the slow request misses it, the rejected one never started.
    assert report["ttft_attainment"] == pytest.approx(0.5)
    assert report["tbt_attainment"] == pytest.approx(0.75)
    assert report["effective_capacity"] == pytest.approx(0.5)
    # Per-request rows carry what the simulator needs to replay the same requests (sim_vs_live.py).
    rows_out = report["per_request"]
    assert [r["max_tokens"] for r in rows_out] == [4, 5, 1, 3]
    assert [r["prompt_words"] for r in rows_out] == [32, 32, 16, 48]
    assert [r["status"] for r in rows_out] == ["", "", "429", ""]

    png = tmp_path / "sweep.png"
    plot_sweep([report | {"target": "fake"}, report | {"target": "fake", "offered_rps": 20.0}], png)
    assert png.stat().st_size > 1000


@pytest.mark.slow
def test_sweep_command_line(fake_server, tmp_path):
    from loadtest.replay.cli import main

    url, seen = fake_server
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 700, "output_length": 2, "hash_ids": [1, i + 2]}) + "\n" for i in range(3)))
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    argv = ["--sweep", "--trace", str(path), "--target", f"a={url}", "--target", f"b={url}", "--time-scales", "1,0.5",
            "--output-scale", "1", "--json", str(out), "--png", str(png)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    assert [(r["target"], r["time_scale"]) for r in rows] == [("a", 1.0), ("b", 1.0), ("a", 0.5), ("b", 0.5)]
    assert all(r["completed"] == 3 and r["effective_capacity"] == 1.0 for r in rows)
    assert rows[2]["offered_rps"] == pytest.approx(2 * rows[0]["offered_rps"])
    assert len(seen) == 12 and png.stat().st_size > 1000
    # each level has its own block text, so one level does not warm the next level's cache
    assert seen[0]["messages"] == seen[3]["messages"] and seen[0]["messages"] != seen[6]["messages"]

    # one server at a time: a sweep by request rate, then both files plotted together
    out2, merged = tmp_path / "rates.json", tmp_path / "merged.json"
    assert main(["--sweep", "--trace", str(path), "--url", url, "--label", "c", "--rates", "40", "--output-scale", "1",
                 "--json", str(out2), "--png", str(png)]) == 0
    assert json.loads(out2.read_text())[0]["offered_rps"] == pytest.approx(40)
    assert main(["--plot-from", str(out), str(out2), "--json", str(merged), "--png", str(png)]) == 0
    assert [r["target"] for r in json.loads(merged.read_text())] == ["a", "b", "a", "b", "c"]


@pytest.mark.slow
def test_tokens_without_text_count_as_completed(fake_server, tmp_path):
    url, _ = fake_server
    trace = [req(0, 0, 512, 6, [1])]
    report = asyncio.run(replay(ReplayConfig(url=url, output_scale=1, max_seconds=30), trace))
    assert report["completed"] == 1 and report["output_tokens"] == 6
    assert report["ttft_s"]["p50"] >= FIRST_DELAY + 5 * GAP  # bounded by the end of the stream
    assert report["per_request"][0]["ok"] and report["per_request"][0]["prompt_tokens"] == 16


@pytest.mark.slow
def test_skip_starts_at_a_window_of_the_trace(fake_server, tmp_path):
    from loadtest.replay.cli import main

    url, seen = fake_server
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 1000 + 100 * i, "input_length": 512 * (i + 1), "output_length": 2,
                                        "hash_ids": list(range(i + 1))}) + "\n" for i in range(6)))
    out = tmp_path / "window.json"
    assert main(["--trace", str(path), "--url", url, "--skip", "3", "--max-requests", "2", "--output-scale", "1",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    # requests 3 and 4 only (4 and 5 blocks): the first sent at once, not after the skipped ones' time
    assert [len(b["messages"][0]["content"].split()) for b in seen] == [64, 80]
    assert report["requests"] == 2 and report["trace_skip"] == 3 and report["wall_s"] < 5
    # the window's own sharing: request 4 repeats request 3's four blocks
    assert report["theoretical_cached_fraction"]["blocks"] == pytest.approx(4 / 9)
    with pytest.raises(SystemExit, match="no requests past"):
        main(["--trace", str(path), "--url", url, "--skip", "6"])


def test_rate_capacity_is_where_the_share_within_slo_crosses_ninety_percent():
    from loadtest.replay.cli import rate_capacity

    def sweep(*points):
        return [{"offered_rps": r, "effective_capacity": k} for r, k in points]

    # 100% at 1.0 req/s, 72% at 1.5: 90% is crossed 10/28 of the way, at ~1.18 req/s
    assert rate_capacity(sweep((1.5, 0.72), (0.5, 1.0), (1.0, 1.0))) == (pytest.approx(1.0 + 0.5 * 10 / 28), False)
    assert rate_capacity(sweep((0.5, 0.95), (1.0, 0.87))) == (pytest.approx(0.5 + 0.5 * 5 / 8), False)
    assert rate_capacity(sweep((0.5, 1.0), (1.0, 0.93))) == (1.0, True)    # never fell short: at least 1.0
    assert rate_capacity(sweep((0.5, 0.80), (1.0, 0.50))) == (None, False)  # short already at the lowest
