"""``crescent profile``: what it measures (on a tiny engine) and what the CLI writes (default model).

Timings on a shared CI machine are noisy, so the tests check what was measured and that the
output feeds the scheduler, not how fast this machine is.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from crescent.services.engine.engine import Engine
from crescent.services.profile import ProfilePlan, Profiler, ProfileThreads, cost_settings_yaml, run_profile, table_rows
from crescent.services.scheduler.config import load_scheduler_settings
from crescent.services.scheduler.cost_model import MixedStepCostModel, MixedStepSample, attention_pairs, fit_mixed_step_model
from crescent.services.scheduler.cost_presets import cost_models_from_settings
from tests.engine.tiny_model import tiny_model

PAGE = 16
PLAN = ProfilePlan(prefill=((32, 0), (96, 0), (160, 0), (160, 64), (160, 128)),
                   decode=((1, 40), (2, 100), (4, 40), (4, 120)), decode_steps=2)
MIXED_PLAN = ProfilePlan(prefill=PLAN.prefill, decode=PLAN.decode, decode_steps=2,
                         mixed=((0, 0, 2, 40), (64, 0, 0, 0), (32, 64, 1, 40), (64, 0, 2, 80), (16, 32, 4, 40), (64, 32, 0, 0)))


@pytest.fixture
def engine() -> Engine:
    torch.set_num_threads(1)
    return Engine(tiny_model(), model_id="tiny", kv_capacity_tokens=MIXED_PLAN.kv_tokens_needed(PAGE), block_size=PAGE)


def test_prefill_points_really_reuse_the_cached_prefix(engine: Engine) -> None:
    profiler = Profiler(engine)
    sample = profiler.prefill(160, 128)
    assert (sample.new_tokens, sample.cached_tokens) == (32, 128)
    cold = profiler.prefill(160, 0)
    assert (cold.new_tokens, cold.cached_tokens) == (160, 0)  # fresh tokens: no accidental hit
    with pytest.raises(ValueError, match="multiple of 16"):
        profiler.prefill(160, 100)


def test_decode_points_leave_the_cache_as_they_found_it(engine: Engine) -> None:
    free = engine.cache.pages.free_pages
    sample = Profiler(engine).decode(4, 120, steps=2)
    assert sample.batch_size == 4
    assert sample.context_tokens == 4 * (120 + 1 + 1)  # mean context over the timed steps
    assert sample.seconds > 0
    assert engine.cache.pages.free_pages == free


def test_fitted_snippet_is_accepted_by_the_scheduler_settings(engine: Engine, tmp_path: Path) -> None:
    progress: list[str] = []
    result = run_profile(engine, PLAN, on_point=progress.append)
    assert len(progress) == PLAN.points  # the progress bar reaches its end
    assert len(result.prefill_samples) == len(PLAN.prefill) and len(result.decode_samples) == len(PLAN.decode)
    path = tmp_path / "scheduler.yaml"
    path.write_text(cost_settings_yaml(result, "measured here\nsecond line"))
    settings = load_scheduler_settings(path)
    models = cost_models_from_settings(settings.cost)
    assert models.prefill.per_token_s == pytest.approx(result.prefill_model.per_token_s, rel=1e-3)
    assert models.decode.fixed_s == pytest.approx(result.decode_model.fixed_s, rel=1e-3, abs=1e-9)
    assert settings.cost.transfer.kv_bytes_per_token == 2 * 2 * 2 * 8 * 4  # layers·(K,V)·heads·dim·fp32
    rows = table_rows(result)
    assert len(rows) == len(PLAN.prefill) + len(PLAN.decode) and all(measured > 0 and fitted >= 0 for _, _, measured, fitted in rows)


def test_mixed_step_fit_recovers_known_coefficients() -> None:
    truth = MixedStepCostModel(fixed_s=0.03, per_prompt_token_s=0.002, attention_s=3e-7, per_sequence_s=0.006,
                               per_context_token_s=4e-6)
    noise = [1.01, 0.99, 1.0, 1.02, 0.98, 1.0, 1.01, 0.99, 1.0, 1.0]  # ±2%, as timings wobble
    points = [(0, 0, 1, 256), (0, 0, 8, 512), (256, 0, 0, 0), (256, 1024, 0, 0), (64, 0, 4, 256),
              (128, 512, 1, 1024), (256, 0, 4, 512), (256, 512, 8, 256), (256, 1536, 16, 512), (128, 0, 16, 256)]
    exact_samples, samples = [], []
    for (u, c, b, ctx), wobble in zip(points, noise):
        seconds = truth.step_seconds([(u, c)], b, b * ctx)
        exact_samples.append(MixedStepSample(u, attention_pairs([(u, c)]), b, b * ctx, seconds))
        samples.append(MixedStepSample(u, attention_pairs([(u, c)]), b, b * ctx, seconds * wobble))
    exact = fit_mixed_step_model(exact_samples)
    for name in ("fixed_s", "per_prompt_token_s", "attention_s", "per_sequence_s", "per_context_token_s"):
        assert getattr(exact, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    noisy = fit_mixed_step_model(samples)
    for (u, c, b, ctx), s in zip(points, samples):  # within the noise everywhere it was measured
        assert noisy.step_seconds([(u, c)], b, b * ctx) == pytest.approx(s.seconds, rel=0.05)
    # One fixed cost for the whole step: mixing a chunk into a decode step costs less than the two apart.
    assert exact.step_seconds([(256, 0)], 8, 8 * 512) == pytest.approx(
        exact.prefill_model().seconds(256) + exact.decode_model().step_seconds(8, 8 * 512) - truth.fixed_s)


def test_mixed_points_time_what_they_say(engine: Engine) -> None:
    free = engine.cache.pages.free_pages
    sample = Profiler(engine).mixed(32, 64, 3, 40, steps=2)
    assert (sample.prompt_tokens, sample.batch_size) == (32, 3)
    assert sample.attention_pairs == 32 * 64 + 32 * 32 / 2
    assert sample.context_tokens == 3 * (40 + 1 + 1) and sample.seconds > 0
    assert engine.cache.pages.free_pages == free  # prompts and decoding sequences released
    alone = Profiler(engine).mixed(0, 0, 2, 40, steps=1)
    assert (alone.prompt_tokens, alone.attention_pairs) == (0, 0)
    with pytest.raises(ValueError, match="prompt chunk or a decode batch"):
        Profiler(engine).mixed(0, 0, 0, 0, steps=1)


def test_both_modes_in_one_snippet_with_each_roles_threads(engine: Engine, tmp_path: Path) -> None:
    seen: list[int] = []
    progress: list[str] = []

    def on_point(what: str) -> None:
        progress.append(what)
        seen.append(torch.get_num_threads())

    threads = ProfileThreads(prefill=2, decode=1, aggregated=2, prefill_beside_decode=1)
    result = run_profile(engine, MIXED_PLAN, on_point=on_point, threads=threads)
    n_prefill, n_decode, n_mixed = len(PLAN.prefill), len(PLAN.decode), len(MIXED_PLAN.mixed)
    assert len(progress) == MIXED_PLAN.points_for(("pools", "aggregated"), threads) == 2 * n_prefill + n_decode + n_mixed
    # Prefill on its threads, prefill again on what decode leaves it, decode, then the aggregated engine's.
    assert seen == [2] * n_prefill + [1] * n_prefill + [1] * n_decode + [2] * n_mixed
    assert torch.get_num_threads() == 1  # put back as it was
    path = tmp_path / "costs.yaml"
    path.write_text(cost_settings_yaml(result))
    models = cost_models_from_settings(load_scheduler_settings(path).cost)
    assert models.mixed is not None and result.mixed_model is not None
    assert models.mixed.per_sequence_s == pytest.approx(result.mixed_model.per_sequence_s, rel=1e-3, abs=1e-12)
    assert models.prefill_beside_decode is not None and result.prefill_beside_decode_model is not None
    assert models.prefill_beside_decode.fixed_s == pytest.approx(result.prefill_beside_decode_model.fixed_s, rel=1e-3, abs=1e-12)
    kinds = [kind for kind, *_ in table_rows(result)]
    assert (kinds.count("mixed step"), kinds.count("prefill beside decode")) == (n_mixed, n_prefill)
    # The aggregated mode alone: the scheduler's prefill and decode models come from the mixed fit.
    only = run_profile(engine, MIXED_PLAN, modes=("aggregated",))
    assert only.prefill_samples == () and only.mixed_model is not None
    assert only.prefill_model == only.mixed_model.prefill_model()
    with pytest.raises(ValueError, match="no mixed-step points"):
        run_profile(engine, PLAN, modes=("aggregated",))


@pytest.mark.slow
def test_cli_quick_profile_writes_yaml_and_prints_a_table(tmp_path: Path) -> None:
    out = tmp_path / "costs.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "crescent.services.cli", "profile", "--quick", "--out", str(out), "--threads", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "measured vs fitted" in done.stderr and "decode step" in done.stderr
    assert out.read_text().startswith("# crescent profile --quick: smollm2-135m-instruct")
    settings = load_scheduler_settings(out)
    assert settings.cost.transfer.kv_bytes_per_token == 46_080  # the default model in fp32
    assert settings.cost.prefill.per_token_s > 0 or settings.cost.prefill.attention_s > 0
