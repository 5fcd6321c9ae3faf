from monoserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "session_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    session_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ...) -> None: ...

class ReplicaChunk(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReplicaFinal(_message.Message):
    __slots__ = ("finish_reason", "stop_token_id", "usage", "timings")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    usage: _common_pb2.Usage
    timings: _common_pb2.ServerTimings
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.ServerTimings, _Mapping]] = ...) -> None: ...

class ReplicaGenerateResponse(_message.Message):
    __slots__ = ("chunk", "final")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    chunk: ReplicaChunk
    final: ReplicaFinal
    def __init__(self, chunk: _Optional[_Union[ReplicaChunk, _Mapping]] = ..., final: _Optional[_Union[ReplicaFinal, _Mapping]] = ...) -> None: ...

class ReplicaAbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReplicaAbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelShape(_message.Message):
    __slots__ = ("architecture", "family", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "dtype", "eos_token_ids", "bos_token_id", "num_parameters")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KEY_VALUE_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    dtype: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    num_parameters: int
    def __init__(self, architecture: _Optional[str] = ..., family: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., intermediate_size: _Optional[int] = ..., num_hidden_layers: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_key_value_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., dtype: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., num_parameters: _Optional[int] = ...) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("replica_id", "model_name", "model_path", "shape", "engine_kind", "gpu_ids", "max_batch", "max_context")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KIND_FIELD_NUMBER: _ClassVar[int]
    GPU_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    model_name: str
    model_path: str
    shape: ModelShape
    engine_kind: str
    gpu_ids: _containers.RepeatedScalarFieldContainer[int]
    max_batch: int
    max_context: int
    def __init__(self, replica_id: _Optional[str] = ..., model_name: _Optional[str] = ..., model_path: _Optional[str] = ..., shape: _Optional[_Union[ModelShape, _Mapping]] = ..., engine_kind: _Optional[str] = ..., gpu_ids: _Optional[_Iterable[int]] = ..., max_batch: _Optional[int] = ..., max_context: _Optional[int] = ...) -> None: ...
