"""Malformed request bytes get INVALID_ARGUMENT naming the message type, not grpcio's bare INTERNAL.

grpcio answers a request that its deserializer cannot parse with INTERNAL ("Exception deserializing
request!") before any servicer code runs. `add_strictly` registers a generated servicer with
deserializers that never raise: a malformed message reaches a thin wrapper, which aborts the call
with INVALID_ARGUMENT and a message naming the type and the parse error. On the way out, a servicer may yield
messages it serialized beforehand (bytes; fedsynth.wire.raw_messages): they are sent as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from fedsynth.wire.raw_messages import passthrough


@dataclass(frozen=True)
class _Malformed:
    type_name: str
    error: str


def _tolerant(deserializer: Callable[[bytes], Any], parse_with: Callable[[bytes], Any] | None = None) -> Callable[[bytes], Any]:
    owner = getattr(deserializer, "__self__", None)  # generated code passes the bound Message.FromString
    type_name = getattr(owner, "__name__", "request")
    deserializer = parse_with or deserializer

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except (DecodeError, ValueError, TypeError) as exc:
            return _Malformed(type_name, str(exc) or type(exc).__name__)

    return parse


def _reject(context: grpc.ServicerContext, bad: _Malformed) -> None:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {bad.type_name}: {bad.error}")


def _checked_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
    for request in requests:
        if isinstance(request, _Malformed):
            _reject(context, request)
        yield request


def _wrap(handler: grpc.RpcMethodHandler, parse_with: Callable[[bytes], Any] | None = None) -> grpc.RpcMethodHandler:
    if handler.request_deserializer is None:
        return handler
    kind = ("stream" if handler.request_streaming else "unary") + "_" + ("stream" if handler.response_streaming else "unary")
    behavior = getattr(handler, kind)
    if handler.request_streaming:
        def wrapped(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            return behavior(_checked_stream(requests, context), context)
    else:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                _reject(context, request)
            return behavior(request, context)
    serializer = handler.response_serializer
    return handler._replace(request_deserializer=_tolerant(handler.request_deserializer, parse_with),
                            response_serializer=serializer and passthrough(serializer), **{kind: wrapped})


class _Registrar:
    """Stands in for the server while generated code registers its handlers, and rewrites them on the way."""

    def __init__(self, server: grpc.Server, parsers: dict[str, Callable[[bytes], Any]]) -> None:
        self.server = server
        self.parsers = parsers

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the registered method handlers below carry every method

    def add_registered_method_handlers(self, service_name: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        strict = {name: _wrap(handler, self.parsers.get(name)) for name, handler in handlers.items()}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, strict),))
        self.server.add_registered_method_handlers(service_name, strict)


def add_strictly(add_servicer: Callable[[Any, Any], None], servicer: Any, server: grpc.Server,
                 parsers: dict[str, Callable[[bytes], Any]] | None = None) -> None:
    """`add_strictly(pb_grpc.add_FooServicer_to_server, servicer, server)` instead of calling the generated adder.
    `parsers`: a method's request parser in place of the generated one (e.g. `raw_messages.parsing_chunks`)."""
    add_servicer(servicer, _Registrar(server, parsers or {}))
