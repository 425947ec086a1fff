"""The side channels (the kvstore's, decode's handoff one) against connections that never say
who they are: they trickle a byte at a time, more of them than there are transfer slots. A peer
with a valid token still gets through while they do, each of them is cut at one deadline for the
handshake and the token together, and every one is counted. A prefill that found a decode's side
channel unusable tries it again after a backoff instead of never."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import grpc
import pytest

from crescent.services.kvwire import movers as movers_module
from crescent.services.kvwire import side_channel, side_channel_client
from crescent.services.kvwire.fused_copy import crc32
from crescent.services.kvwire.side_channel import SideChannelServer
from crescent.services.kvwire.side_channel_client import send_payloads
from crescent.services.prefill import handoff_mover
from crescent.services.prefill.handoff_mover import TCP, HandoffMovers

SLOTS = 8
DRIBBLERS = 20        # more than the slots, as 320 against decode's 256 were
DEADLINE_S = 1.0      # TOKEN_TIMEOUT_S, shortened for the test
TRICKLE_S = 0.25      # each dribbler sends a byte this often: never silent for a whole recv timeout


def dribble(port: int, stop: threading.Event, cut: list[float], started: float) -> None:
    """Connect and send a byte every TRICKLE_S, never a whole hello; note when the node cut us."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            while not stop.is_set():
                sock.sendall(b"x")
                time.sleep(TRICKLE_S)
                sock.settimeout(0.01)
                try:
                    if sock.recv(1) == b"":
                        break  # closed by the node
                except TimeoutError:
                    pass
                except OSError:
                    break
        except OSError:
            pass  # the node cut us mid-send
        cut.append(time.monotonic() - started)


async def test_trickling_connections_neither_hold_the_slots_nor_last(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(side_channel, "TOKEN_TIMEOUT_S", DEADLINE_S)
    refused: list[int] = []
    server = SideChannelServer("127.0.0.1", max_connections=SLOTS, on_refused=lambda: refused.append(1))
    stop, cut = threading.Event(), []
    started = time.monotonic()
    threads = [threading.Thread(target=dribble, args=(server.port, stop, cut, started), daemon=True)
               for _ in range(DRIBBLERS)]
    try:
        for thread in threads:
            thread.start()
        await asyncio.sleep(0.3)  # every dribbler connected and trickling
        data = os.urandom(1 << 20)
        room = bytearray(len(data))
        token, landed = server.expect_receive([memoryview(room)], [crc32(data)])
        answers = await asyncio.to_thread(send_payloads, f"127.0.0.1:{server.port}", token, [data], timeout_s=5)
        assert answers == [True] and await landed == [True] and bytes(room) == data, \
            "a peer with a token got through while the dribblers were connected"
        for thread in threads:
            thread.join(DEADLINE_S + 3)
        assert len(cut) == DRIBBLERS, "every dribbler was cut"
        assert max(cut) < DEADLINE_S + 1.0, f"cut at {max(cut):.2f} s: one deadline, not one per byte"
        assert server.refused >= DRIBBLERS and len(refused) == server.refused, "each one counted"
    finally:
        stop.set()
        side_channel_client.close_kept_connections()
        server.close()


async def test_beyond_the_handshake_permits_connections_are_refused_and_counted(monkeypatch) -> None:
    monkeypatch.setattr(side_channel, "TOKEN_TIMEOUT_S", DEADLINE_S)
    server = SideChannelServer("127.0.0.1", max_connections=1)  # 4 connections may be saying who they are
    socks = []
    try:
        for _ in range(6):
            socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        await asyncio.sleep(0.3)
        assert server.refused >= 2, "the fifth and sixth were closed at once"
        await asyncio.sleep(DEADLINE_S + 0.5)
        assert server.refused == 6, "and the four silent ones at the deadline"
    finally:
        for sock in socks:
            sock.close()
        server.close()


def unusable() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details="tcp handoff: the side channel is not open")


def test_a_side_channel_found_unusable_is_tried_again_after_a_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(movers_module.time, "monotonic", lambda: now[0])  # the ladder keeps the backoff
    movers = HandoffMovers("prefill-0", shared_memory=False, tcp=True)
    peer = "decode-0:50053"
    assert movers.uses_tcp(peer)
    movers.tcp_failed(peer, unusable())
    assert not movers.uses_tcp(peer), "gRPC for a while"
    now[0] += handoff_mover.TCP_RETRY_FIRST_S
    assert movers.uses_tcp(peer), "then the side channel again"
    movers.tcp_failed(peer, unusable())  # still broken: wait twice as long
    now[0] += handoff_mover.TCP_RETRY_FIRST_S
    assert not movers.uses_tcp(peer)
    now[0] += handoff_mover.TCP_RETRY_FIRST_S
    assert movers.uses_tcp(peer)
    movers.handed_off(peer, TCP, 1 << 20)  # it worked: a later failure starts from the first backoff
    movers.tcp_failed(peer, unusable())
    now[0] += handoff_mover.TCP_RETRY_FIRST_S
    assert movers.uses_tcp(peer)
    for _ in range(20):
        movers.tcp_failed(peer, unusable())
    now[0] += handoff_mover.TCP_RETRY_MAX_S
    assert movers.uses_tcp(peer), "the backoff is bounded"
