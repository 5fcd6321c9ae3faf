from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_DEADLINE: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_DEADLINE: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class ServerTimings(_message.Message):
    __slots__ = ("queue_ms", "ttft_ms", "mean_tpot_ms", "total_ms", "prefill_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    MEAN_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    ttft_ms: float
    mean_tpot_ms: float
    total_ms: float
    prefill_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., mean_tpot_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ...) -> None: ...

class ReplicaLoad(_message.Message):
    __slots__ = ("replica_id", "capacity", "busy_slots", "tokens_remaining", "tpot_ewma_ms", "expected_idle_ms", "healthy", "draining", "tpot_ms_by_occupancy", "expected_slot_free_ms", "prefill_ms_per_token", "version", "session_cache")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    BUSY_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_REMAINING_FIELD_NUMBER: _ClassVar[int]
    TPOT_EWMA_MS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_BY_OCCUPANCY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SLOT_FREE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_CACHE_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    capacity: int
    busy_slots: int
    tokens_remaining: int
    tpot_ewma_ms: float
    expected_idle_ms: float
    healthy: bool
    draining: bool
    tpot_ms_by_occupancy: _containers.RepeatedScalarFieldContainer[float]
    expected_slot_free_ms: float
    prefill_ms_per_token: float
    version: int
    session_cache: SessionCacheStats
    def __init__(self, replica_id: _Optional[str] = ..., capacity: _Optional[int] = ..., busy_slots: _Optional[int] = ..., tokens_remaining: _Optional[int] = ..., tpot_ewma_ms: _Optional[float] = ..., expected_idle_ms: _Optional[float] = ..., healthy: _Optional[bool] = ..., draining: _Optional[bool] = ..., tpot_ms_by_occupancy: _Optional[_Iterable[float]] = ..., expected_slot_free_ms: _Optional[float] = ..., prefill_ms_per_token: _Optional[float] = ..., version: _Optional[int] = ..., session_cache: _Optional[_Union[SessionCacheStats, _Mapping]] = ...) -> None: ...

class SessionCacheStats(_message.Message):
    __slots__ = ("hits", "misses", "evictions", "reused_tokens", "sessions", "bytes", "max_bytes", "max_sessions")
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    hits: int
    misses: int
    evictions: int
    reused_tokens: int
    sessions: int
    bytes: int
    max_bytes: int
    max_sessions: int
    def __init__(self, hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., sessions: _Optional[int] = ..., bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ..., max_sessions: _Optional[int] = ...) -> None: ...
