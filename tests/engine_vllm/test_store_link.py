"""The connector's queue of kvstore puts: an aggregated instance drops blocks when too many are
on their way (the step must not wait on the store), a prefill instance waits for room, since its
saves are how its prompts reach decode."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from crescent.services.engine_vllm import store_link
from crescent.services.engine_vllm.connector_options import ConnectorOptions
from crescent.services.engine_vllm.store_link import MAX_PUTS_IN_FLIGHT, StoreLink

PUT_S = 0.3  # how long the stand-in store takes to answer a put


class SlowStore:
    """Answers every put after PUT_S; remembers how many blocks it was given."""

    def __init__(self) -> None:
        self.stored = 0

    async def put(self, blocks: list) -> SimpleNamespace:
        await asyncio.sleep(PUT_S)
        self.stored += len(blocks)
        return SimpleNamespace(failed=0, rejected=0, stored=len(blocks))

    async def close(self) -> None:
        pass


@pytest.fixture
def link_for(monkeypatch: pytest.MonkeyPatch):
    links = []

    def make(saves_wait: bool) -> tuple[StoreLink, SlowStore]:
        store = SlowStore()

        async def client(self, tls) -> SlowStore:  # noqa: ANN001
            return store

        monkeypatch.setattr(StoreLink, "_make_client", client)
        link = StoreLink(ConnectorOptions(model_id="m", block_size=64, kvstore_address="127.0.0.1:1",
                                          saves_wait=saves_wait))
        links.append(link)
        return link, store

    yield make
    for link in links:
        link.close()


def test_a_full_queue_drops_blocks_on_an_aggregated_instance(link_for) -> None:
    link, store = link_for(saves_wait=False)
    assert link.put_soon([None] * MAX_PUTS_IN_FLIGHT) is not None
    started = time.monotonic()
    assert link.put_soon([None]) is None, "no room: dropped, not waited for"
    assert time.monotonic() - started < PUT_S / 2
    link.flush()
    assert store.stored == MAX_PUTS_IN_FLIGHT and link.dropped_puts == 1


def test_a_full_queue_holds_a_prefills_step_until_there_is_room(link_for) -> None:
    link, store = link_for(saves_wait=True)
    assert link.put_soon([None] * MAX_PUTS_IN_FLIGHT) is not None
    started = time.monotonic()
    assert link.put_soon([None] * 3) is not None, "waited for room instead of dropping"
    assert time.monotonic() - started >= PUT_S * 0.8
    assert link.put_soon([None] * (MAX_PUTS_IN_FLIGHT + 10)) is not None, "a step larger than the queue still goes"
    link.flush()
    assert store.stored == 2 * MAX_PUTS_IN_FLIGHT + 13 and link.dropped_puts == 0


def test_a_prefill_gives_up_waiting_after_the_room_timeout(link_for, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_link, "PUT_ROOM_TIMEOUT_S", 0.05)
    link, _ = link_for(saves_wait=True)
    assert link.put_soon([None] * MAX_PUTS_IN_FLIGHT) is not None
    assert link.put_soon([None]) is None and link.dropped_puts == 1
    link.flush()
