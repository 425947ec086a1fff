"""A progress bar for tensor loading (rich, on stderr); nothing when disabled or not a terminal."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

T = TypeVar("T")


def track(items: Iterable[T], *, total: int, description: str, enabled: bool) -> Iterator[T]:
    console = Console(stderr=True)
    if not enabled or not console.is_terminal:  # service logs get a log line instead
        yield from items
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)
