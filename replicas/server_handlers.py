"""Register a grpc.aio servicer so that undecodable request bytes get INVALID_ARGUMENT, not UNKNOWN.

The generated `add_*Servicer_to_server` lets a protobuf DecodeError escape from the request
deserializer, which gRPC reports as UNKNOWN. Here every request is decoded by a deserializer that
never raises; a malformed request reaches a wrapper that aborts with INVALID_ARGUMENT and says
which message could not be parsed.
"""

from __future__ import annotations

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import FileDescriptor
from google.protobuf.message import DecodeError


class _Malformed:
    def __init__(self, type_name: str, error: Exception):
        self.message = f"request is not a valid {type_name} message ({error}); send a serialized {type_name}"


def _decoder(cls):
    def decode(raw: bytes):
        try:
            return cls.FromString(raw)
        except (DecodeError, RuntimeError, ValueError) as e:
            return _Malformed(cls.DESCRIPTOR.full_name, e)
    return decode


def _serialize(message) -> bytes:
    return message.SerializeToString()


def _unary(fn):
    async def handler(request, context):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await fn(request, context)
    return handler


def _streaming(fn):
    async def handler(request, context):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        async for response in fn(request, context):
            yield response
    return handler


def add_servicer(servicer, server: grpc.aio.Server, file: FileDescriptor, service_name: str) -> None:
    """Serve `servicer`'s methods for `service_name` (declared in the proto `file`) on `server`."""
    service = file.services_by_name[service_name]
    handlers = {}
    for method in service.methods:
        if method.client_streaming:
            raise NotImplementedError(f"{method.full_name}: client streaming is not used by monoserve")
        fn = getattr(servicer, method.name)
        kw = dict(request_deserializer=_decoder(message_factory.GetMessageClass(method.input_type)),
                  response_serializer=_serialize)
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(_streaming(fn), **kw)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(_unary(fn), **kw)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
