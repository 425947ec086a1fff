"""What loopback itself allows on this machine, as a yardstick for the kvstore's gRPC path:

- plain TCP: a socket pair over 127.0.0.1, ``sendall`` of one buffer, ``recv_into`` one reused
  buffer (no Python-level copy at all);
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
import time
from concurrent import futures

MIB = 1 << 20


def _tcp_sink(listener: socket.socket, chunk: int) -> None:
    conn, _ = listener.accept()
    buffer = memoryview(bytearray(chunk))
    while conn.recv_into(buffer):
        pass
    conn.sendall(b"k")
    conn.close()


def tcp_gbps(chunk: int, total: int) -> float:
    """Bytes per second through one loopback TCP connection."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    sink = multiprocessing.get_context("fork").Process(target=_tcp_sink, args=(listener, chunk), daemon=True)
    sink.start()
    payload = os.urandom(chunk)
    with socket.create_connection(listener.getsockname()) as conn:
        start = time.perf_counter()
        for _ in range(total // chunk):
            conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # the sink has read everything
        seconds = time.perf_counter() - start
    sink.join(10)
    listener.close()
    return total // chunk * chunk / seconds / 1e9


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
