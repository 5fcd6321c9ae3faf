from monoserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_STATE_UNSPECIFIED: _ClassVar[ReplicaState]
    REPLICA_STATE_CONNECTING: _ClassVar[ReplicaState]
    REPLICA_STATE_READY: _ClassVar[ReplicaState]
    REPLICA_STATE_EJECTED: _ClassVar[ReplicaState]
    REPLICA_STATE_DRAINING: _ClassVar[ReplicaState]
REPLICA_STATE_UNSPECIFIED: ReplicaState
REPLICA_STATE_CONNECTING: ReplicaState
REPLICA_STATE_READY: ReplicaState
REPLICA_STATE_EJECTED: ReplicaState
REPLICA_STATE_DRAINING: ReplicaState

class AddReplicaRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class AddReplicaResponse(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: ReplicaStatus
    def __init__(self, replica: _Optional[_Union[ReplicaStatus, _Mapping]] = ...) -> None: ...

class RemoveReplicaRequest(_message.Message):
    __slots__ = ("address", "drain")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    address: str
    drain: bool
    def __init__(self, address: _Optional[str] = ..., drain: _Optional[bool] = ...) -> None: ...

class RemoveReplicaResponse(_message.Message):
    __slots__ = ("running_requests",)
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    def __init__(self, running_requests: _Optional[int] = ...) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("address", "state", "load", "last_error", "router_running")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    ROUTER_RUNNING_FIELD_NUMBER: _ClassVar[int]
    address: str
    state: ReplicaState
    load: _common_pb2.ReplicaLoad
    last_error: str
    router_running: int
    def __init__(self, address: _Optional[str] = ..., state: _Optional[_Union[ReplicaState, str]] = ..., load: _Optional[_Union[_common_pb2.ReplicaLoad, _Mapping]] = ..., last_error: _Optional[str] = ..., router_running: _Optional[int] = ...) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("replicas", "queue_depth", "queue_capacity")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    queue_depth: int
    queue_capacity: int
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., queue_depth: _Optional[int] = ..., queue_capacity: _Optional[int] = ...) -> None: ...
