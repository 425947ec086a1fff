"""Fixtures: a real scheduler process on 127.0.0.1, stopped after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from .support import SchedulerProcess, free_port


@pytest.fixture
def start_scheduler(tmp_path: Path) -> Iterator[Callable[..., SchedulerProcess]]:
    started: list[SchedulerProcess] = []

    def start(**settings: Any) -> SchedulerProcess:
        port, admin_port = free_port(), free_port()
        settings.setdefault("listen", {"host": "127.0.0.1", "port": port, "admin_port": admin_port})
        config = tmp_path / f"scheduler-{len(started)}.yaml"
        config.write_text(yaml.safe_dump(settings))
        sched = SchedulerProcess(config, port, admin_port)
        started.append(sched)
        sched.start()
        return sched

    yield start
    for sched in started:
        sched.stop()
