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
from crescent.services.profile import ProfilePlan, Profiler, cost_settings_yaml, run_profile, table_rows
from crescent.services.scheduler.config import load_scheduler_settings
from crescent.services.scheduler.cost_presets import cost_models_from_settings
from tests.engine.tiny_model import tiny_model

PAGE = 16
PLAN = ProfilePlan(prefill=((32, 0), (96, 0), (160, 0), (160, 64), (160, 128)),
                   decode=((1, 40), (2, 100), (4, 40), (4, 120)), decode_steps=2)


@pytest.fixture
def engine() -> Engine:
    torch.set_num_threads(1)
    return Engine(tiny_model(), model_id="tiny", kv_capacity_tokens=PLAN.kv_tokens_needed(PAGE), page_size=PAGE)


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
