"""Registering a generated gRPC servicer with ``chunk_wire``'s codecs on the methods that carry
KV blocks, and calling those methods with them.

The generated ``add_XServicer_to_server`` builds handlers with protobuf's (de)serializers; here
the handlers it builds are taken, the named methods' codecs replaced, and the table registered
on the real server. The bytes on the wire are unchanged: only the copies go.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import grpc

Codec = Callable[[Any], Any]


def add_with_codecs(add_to_server: Callable[[Any, Any], None], servicer: Any, server: grpc.aio.Server, *,
                    requests: Mapping[str, Codec] = {}, replies: Mapping[str, Codec] = {}) -> None:
    """``add_to_server(servicer, server)`` (a generated function), with ``requests[method]`` as that
    method's request deserializer and ``replies[method]`` as its response serializer."""

    class _Swap:
        def add_generic_rpc_handlers(self, handlers: Any) -> None:
            pass  # rebuilt below from the swapped table

        def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
            for method in {*requests, *replies}:
                if method not in handlers:
                    raise ValueError(f"{service} has no method {method!r}; it has {', '.join(sorted(handlers))}")
            for method, decode in requests.items():
                handlers[method] = handlers[method]._replace(request_deserializer=decode)
            for method, encode in replies.items():
                handlers[method] = handlers[method]._replace(response_serializer=encode)
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
            server.add_registered_method_handlers(service, handlers)

    add_to_server(servicer, _Swap())
