"""What loopback itself allows on this machine, as a yardstick for the kvstore's gRPC path:

- plain TCP: a socket pair over 127.0.0.1, ``sendall`` of one buffer, ``recv_into`` one reused
  buffer (no Python-level copy at all); also over two connections at once, as the kvstore's TCP
  side channel stripes a large transfer;
- plain grpcio: a stream of raw ``bytes`` messages (no protobuf, no store), one direction.

    .venv/bin/python loadtest/transport_ceiling.py [--chunk-mib 4] [--total-mib 512]

Prints GB/s for each, medians of three runs.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import threading
import time
from concurrent import futures

MIB = 1 << 20


def _drain(conn: socket.socket, chunk: int) -> None:
    buffer = memoryview(bytearray(chunk))
    while conn.recv_into(buffer):
        pass
    conn.sendall(b"k")
    conn.close()


def _tcp_sink(listener: socket.socket, chunk: int, connections: int) -> None:
    conns = [listener.accept()[0] for _ in range(connections)]
    threads = [threading.Thread(target=_drain, args=(conn, chunk)) for conn in conns]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _tcp_source(conn: socket.socket, payload: bytes, count: int) -> None:
    for _ in range(count):
        conn.sendall(payload)
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)  # the sink has read everything


def tcp_gbps(chunk: int, total: int, connections: int = 1) -> float:
    """Bytes per second through ``connections`` loopback TCP connections at once (each carries
    an equal share, sent and drained on threads of their own)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(connections)
    sink = multiprocessing.get_context("fork").Process(target=_tcp_sink, args=(listener, chunk, connections),
                                                       daemon=True)
    sink.start()
    payload = os.urandom(chunk)
    count = total // chunk // connections
    conns = [socket.create_connection(listener.getsockname()) for _ in range(connections)]
    try:
        start = time.perf_counter()
        threads = [threading.Thread(target=_tcp_source, args=(conn, payload, count)) for conn in conns]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - start
    finally:
        for conn in conns:
            conn.close()
    sink.join(10)
    listener.close()
    return count * connections * chunk / seconds / 1e9


_OPTIONS = [("grpc.max_receive_message_length", 256 * MIB), ("grpc.max_send_message_length", 256 * MIB)]


def _grpc_sink(port_out, chunk: int) -> None:  # noqa: ANN001 - a multiprocessing queue
    import grpc

    def drain(requests, context):  # noqa: ANN001, ANN202
        return str(sum(len(r) for r in requests)).encode()

    handler = grpc.method_handlers_generic_handler(
        "Sink", {"Drain": grpc.stream_unary_rpc_method_handler(drain, lambda b: b, lambda b: b)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(2), options=_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port_out.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def grpc_gbps(chunk: int, total: int) -> float:
    """Bytes per second through one grpcio stream of raw bytes messages."""
    import grpc

    context = multiprocessing.get_context("spawn")  # grpcio does not survive fork
    ports = context.Queue()
    sink = context.Process(target=_grpc_sink, args=(ports, chunk), daemon=True)
    sink.start()
    try:
        port = ports.get(timeout=30)
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=_OPTIONS) as channel:
            drain = channel.stream_unary("/Sink/Drain", lambda b: b, lambda b: b)
            grpc.channel_ready_future(channel).result(timeout=30)
            payload = os.urandom(chunk)
            drain(iter([payload]))  # warm the connection
            start = time.perf_counter()
            got = int(drain(iter([payload] * (total // chunk))))
            seconds = time.perf_counter() - start
        return got / seconds / 1e9
    finally:
        sink.kill()
        sink.join(10)


def ceilings(chunk: int, total: int, runs: int = 3) -> dict[str, float]:
    return {
        "tcp_loopback_gbps": statistics.median(tcp_gbps(chunk, total) for _ in range(runs)),
        "tcp_loopback_2_connections_gbps": statistics.median(tcp_gbps(chunk, total, 2) for _ in range(runs)),
        "grpcio_raw_gbps": statistics.median(grpc_gbps(chunk, total) for _ in range(runs)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk-mib", type=int, default=4)
    parser.add_argument("--total-mib", type=int, default=512)
    args = parser.parse_args()
    for name, value in ceilings(args.chunk_mib * MIB, args.total_mib * MIB).items():
        print(f"{name}: {value:.2f} GB/s")


if __name__ == "__main__":
    main()
