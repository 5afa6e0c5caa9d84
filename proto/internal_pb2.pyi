from proto import pdserve_pb2 as _pdserve_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeFlushRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeLoadLoRARequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class NodeUnloadLoRARequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class NodeLoRAResponse(_message.Message):
    __slots__ = ("name", "digest", "rank", "requests_in_flight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: str
    rank: int
    requests_in_flight: int
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[str] = ..., rank: _Optional[int] = ..., requests_in_flight: _Optional[int] = ...) -> None: ...

class NodeFlushResponse(_message.Message):
    __slots__ = ("blocks_flushed",)
    BLOCKS_FLUSHED_FIELD_NUMBER: _ClassVar[int]
    blocks_flushed: int
    def __init__(self, blocks_flushed: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "prefill", "resume_offset", "reservation_id", "traceparent", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    RESUME_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _pdserve_pb2.SamplingParams
    cache_salt: str
    prefill: NodeRef
    resume_offset: int
    reservation_id: int
    traceparent: str
    lora: LoRAAdapterRef
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_pdserve_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., prefill: _Optional[_Union[NodeRef, _Mapping]] = ..., resume_offset: _Optional[int] = ..., reservation_id: _Optional[int] = ..., traceparent: _Optional[str] = ..., lora: _Optional[_Union[LoRAAdapterRef, _Mapping]] = ...) -> None: ...

class LoRAAdapterRef(_message.Message):
    __slots__ = ("name", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: str
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class SessionCommand(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: SessionStart
    cancel: str
    def __init__(self, start: _Optional[_Union[SessionStart, _Mapping]] = ..., cancel: _Optional[str] = ...) -> None: ...

class SessionStart(_message.Message):
    __slots__ = ("request", "timeout_s")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request: DecodeRequest
    timeout_s: float
    def __init__(self, request: _Optional[_Union[DecodeRequest, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class SessionBatch(_message.Message):
    __slots__ = ("events", "protocol_version")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[SessionEvent]
    protocol_version: int
    def __init__(self, events: _Optional[_Iterable[_Union[SessionEvent, _Mapping]]] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("request_id", "response", "end")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: _pdserve_pb2.GenerateResponse
    end: SessionEnd
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[_pdserve_pb2.GenerateResponse, _Mapping]] = ..., end: _Optional[_Union[SessionEnd, _Mapping]] = ...) -> None: ...

class SessionEnd(_message.Message):
    __slots__ = ("code", "details", "failed_node")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    FAILED_NODE_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    failed_node: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., failed_node: _Optional[str] = ...) -> None: ...

class NodeRef(_message.Message):
    __slots__ = ("node_id", "address", "tensor_parallel_size")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    tensor_parallel_size: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "resume_offset", "decode_node_id", "decode_tensor_parallel_size", "reservation_id", "traceparent", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RESUME_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _pdserve_pb2.SamplingParams
    cache_salt: str
    resume_offset: int
    decode_node_id: str
    decode_tensor_parallel_size: int
    reservation_id: int
    traceparent: str
    lora: LoRAAdapterRef
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_pdserve_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., resume_offset: _Optional[int] = ..., decode_node_id: _Optional[str] = ..., decode_tensor_parallel_size: _Optional[int] = ..., reservation_id: _Optional[int] = ..., traceparent: _Optional[str] = ..., lora: _Optional[_Union[LoRAAdapterRef, _Mapping]] = ...) -> None: ...

class PrefillSessionCommand(_message.Message):
    __slots__ = ("start", "cancel", "blocks")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    start: PrefillSessionStart
    cancel: str
    blocks: PrefillBlocks
    def __init__(self, start: _Optional[_Union[PrefillSessionStart, _Mapping]] = ..., cancel: _Optional[str] = ..., blocks: _Optional[_Union[PrefillBlocks, _Mapping]] = ...) -> None: ...

class PrefillSessionStart(_message.Message):
    __slots__ = ("request", "timeout_s")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request: PrefillRequest
    timeout_s: float
    def __init__(self, request: _Optional[_Union[PrefillRequest, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class PrefillBlocks(_message.Message):
    __slots__ = ("request_id", "reservation_id", "first_block", "num_blocks", "channel")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reservation_id: int
    first_block: int
    num_blocks: int
    channel: KVChannel
    def __init__(self, request_id: _Optional[str] = ..., reservation_id: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., channel: _Optional[_Union[KVChannel, _Mapping]] = ...) -> None: ...

class KVChannel(_message.Message):
    __slots__ = ("node_id", "store_host", "store_port", "epoch", "tensor_parallel_size", "kv_cache_dtype")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    store_host: str
    store_port: int
    epoch: int
    tensor_parallel_size: int
    kv_cache_dtype: str
    def __init__(self, node_id: _Optional[str] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., epoch: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ...) -> None: ...

class PrefillSessionBatch(_message.Message):
    __slots__ = ("events", "protocol_version")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[PrefillSessionEvent]
    protocol_version: int
    def __init__(self, events: _Optional[_Iterable[_Union[PrefillSessionEvent, _Mapping]]] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class PrefillSessionEvent(_message.Message):
    __slots__ = ("request_id", "response", "end")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: PrefillResponse
    end: SessionEnd
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[PrefillResponse, _Mapping]] = ..., end: _Optional[_Union[SessionEnd, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("cached_tokens", "queue_ms", "compute_ms", "transfer_ms", "transfer_bytes", "node_ms")
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    NODE_MS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    queue_ms: float
    compute_ms: float
    transfer_ms: float
    transfer_bytes: int
    node_ms: float
    def __init__(self, cached_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., node_ms: _Optional[float] = ...) -> None: ...
