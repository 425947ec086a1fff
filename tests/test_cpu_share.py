"""How ``crescent up`` splits the cores among engine processes (services/cpu_share.py)."""

from __future__ import annotations

import pytest

from crescent.services.cpu_share import EngineThreads, share_cores
from crescent.services.launcher import Platform, PlatformPlan, child_env
from tests.ports import free_port


def test_two_cores_give_decode_one_thread_and_prefill_two_that_wait_passively() -> None:
    threads = share_cores(2, prefill=1, decode=1)
    assert threads == EngineThreads(prefill=2, decode=1, prefill_passive=True)
    assert threads.env("prefill") == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    assert threads.env("decode") == {"OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize(("cores", "prefill", "decode"), [(4, 1, 1), (8, 2, 2), (16, 1, 3)])
def test_enough_cores_keep_full_spinning_teams(cores: int, prefill: int, decode: int) -> None:
    assert share_cores(cores, prefill, decode) == EngineThreads(prefill=2, decode=2, prefill_passive=False)


@pytest.mark.parametrize(("cores", "prefill", "decode"), [(1, 1, 1), (2, 2, 1), (3, 1, 2), (6, 2, 2)])
def test_short_of_cores_decode_never_gets_more_than_one_and_teams_fit_or_wait_passively(
        cores: int, prefill: int, decode: int) -> None:
    threads = share_cores(cores, prefill, decode)
    assert threads.decode == 1
    assert 1 <= threads.prefill <= min(2, cores)
    assert threads.prefill_passive == (prefill * threads.prefill + decode > cores)


def test_crescent_up_configures_each_engine_with_its_share(tmp_path) -> None:
    plan = PlatformPlan("m", "127.0.0.1", free_port(), 1, 2, 256, 1 << 20, 16, tls=False, cores=2)
    engines = {spec.name: spec for spec in Platform(plan, tmp_path).specs if spec.service in ("prefill", "decode")}
    assert engines["prefill-0"].config["engine"]["threads"] == 2
    assert engines["prefill-0"].env["OMP_WAIT_POLICY"] == "PASSIVE"
    for name in ("decode-0", "decode-1"):
        assert engines[name].config["engine"]["threads"] == 1
        assert engines[name].env == {"OMP_NUM_THREADS": "1"}


def test_each_engine_process_starts_with_its_share_in_its_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "8")  # the operator's own setting loses to the split
    plan = PlatformPlan("m", "127.0.0.1", free_port(), 1, 1, 256, 1 << 20, 16, tls=False, cores=2)
    envs = {spec.name: child_env(spec) for spec in Platform(plan, tmp_path).specs}
    assert envs["decode-0"]["OMP_NUM_THREADS"] == "1" and "OMP_WAIT_POLICY" not in envs["decode-0"]
    assert envs["prefill-0"]["OMP_NUM_THREADS"] == "2" and envs["prefill-0"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert envs["gateway"]["OMP_NUM_THREADS"] == "8"


def test_one_aggregated_engine_gets_every_core_spinning(tmp_path) -> None:
    plan = PlatformPlan("m", "127.0.0.1", free_port(), 1, 1, 256, 1 << 20, 16, tls=False, cores=2, aggregated=1)
    engines = [spec for spec in Platform(plan, tmp_path).specs if spec.service in ("prefill", "decode", "aggregated")]
    assert [spec.name for spec in engines] == ["aggregated-0"]
    assert engines[0].config["engine"]["threads"] == 2 and "OMP_WAIT_POLICY" not in child_env(engines[0])
