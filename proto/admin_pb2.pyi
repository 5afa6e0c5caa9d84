from proto import pdserve_pb2 as _pdserve_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "role", "address", "kv_blocks_total", "kv_blocks_free", "running", "waiting", "queued_prefill_tokens", "cached_blocks", "draining", "heartbeat_age_ms", "requests_total", "preemptions", "computed_tokens_total", "generated_tokens_total", "tensor_parallel_size", "num_gpus", "model_family", "host_kv_blocks_total", "host_kv_blocks_free", "host_cached_blocks", "weight_dtype", "kv_cache_dtype")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPUS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FAMILY_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    address: str
    kv_blocks_total: int
    kv_blocks_free: int
    running: int
    waiting: int
    queued_prefill_tokens: int
    cached_blocks: int
    draining: bool
    heartbeat_age_ms: int
    requests_total: int
    preemptions: int
    computed_tokens_total: int
    generated_tokens_total: int
    tensor_parallel_size: int
    num_gpus: int
    model_family: str
    host_kv_blocks_total: int
    host_kv_blocks_free: int
    host_cached_blocks: int
    weight_dtype: str
    kv_cache_dtype: str
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., draining: _Optional[bool] = ..., heartbeat_age_ms: _Optional[int] = ..., requests_total: _Optional[int] = ..., preemptions: _Optional[int] = ..., computed_tokens_total: _Optional[int] = ..., generated_tokens_total: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., num_gpus: _Optional[int] = ..., model_family: _Optional[str] = ..., host_kv_blocks_total: _Optional[int] = ..., host_kv_blocks_free: _Optional[int] = ..., host_cached_blocks: _Optional[int] = ..., weight_dtype: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LatencySummary(_message.Message):
    __slots__ = ("count", "mean_ms", "p50_ms", "p90_ms", "p99_ms")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MEAN_MS_FIELD_NUMBER: _ClassVar[int]
    P50_MS_FIELD_NUMBER: _ClassVar[int]
    P90_MS_FIELD_NUMBER: _ClassVar[int]
    P99_MS_FIELD_NUMBER: _ClassVar[int]
    count: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    def __init__(self, count: _Optional[int] = ..., mean_ms: _Optional[float] = ..., p50_ms: _Optional[float] = ..., p90_ms: _Optional[float] = ..., p99_ms: _Optional[float] = ...) -> None: ...

class NodeCount(_message.Message):
    __slots__ = ("node_id", "count")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    count: int
    def __init__(self, node_id: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class StatusCount(_message.Message):
    __slots__ = ("status", "count")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    status: str
    count: int
    def __init__(self, status: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("ttft", "tpot", "itl", "e2e", "prefix_hit_rate", "prompt_tokens", "cached_tokens", "requests_per_decode_node", "requests_per_prefill_node", "local_prefills", "requests_by_status", "in_flight", "preemptions", "kv_transfers", "kv_transfer_bytes", "kv_transfer_gbps", "kv_transfer_failures", "uptime_s", "spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")
    TTFT_FIELD_NUMBER: _ClassVar[int]
    TPOT_FIELD_NUMBER: _ClassVar[int]
    ITL_FIELD_NUMBER: _ClassVar[int]
    E2E_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_DECODE_NODE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_PREFILL_NODE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_BY_STATUS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_GBPS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ttft: LatencySummary
    tpot: LatencySummary
    itl: LatencySummary
    e2e: LatencySummary
    prefix_hit_rate: float
    prompt_tokens: int
    cached_tokens: int
    requests_per_decode_node: _containers.RepeatedCompositeFieldContainer[NodeCount]
    requests_per_prefill_node: _containers.RepeatedCompositeFieldContainer[NodeCount]
    local_prefills: int
    requests_by_status: _containers.RepeatedCompositeFieldContainer[StatusCount]
    in_flight: int
    preemptions: int
    kv_transfers: int
    kv_transfer_bytes: int
    kv_transfer_gbps: float
    kv_transfer_failures: int
    uptime_s: float
    spec_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    def __init__(self, ttft: _Optional[_Union[LatencySummary, _Mapping]] = ..., tpot: _Optional[_Union[LatencySummary, _Mapping]] = ..., itl: _Optional[_Union[LatencySummary, _Mapping]] = ..., e2e: _Optional[_Union[LatencySummary, _Mapping]] = ..., prefix_hit_rate: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., requests_per_decode_node: _Optional[_Iterable[_Union[NodeCount, _Mapping]]] = ..., requests_per_prefill_node: _Optional[_Iterable[_Union[NodeCount, _Mapping]]] = ..., local_prefills: _Optional[int] = ..., requests_by_status: _Optional[_Iterable[_Union[StatusCount, _Mapping]]] = ..., in_flight: _Optional[int] = ..., preemptions: _Optional[int] = ..., kv_transfers: _Optional[int] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_transfer_gbps: _Optional[float] = ..., kv_transfer_failures: _Optional[int] = ..., uptime_s: _Optional[float] = ..., spec_drafts: _Optional[int] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ...) -> None: ...

class ExplainRouteRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: _pdserve_pb2.GenerateRequest
    def __init__(self, request: _Optional[_Union[_pdserve_pb2.GenerateRequest, _Mapping]] = ...) -> None: ...

class NodeScore(_message.Message):
    __slots__ = ("node_id", "role", "hit_blocks", "cost", "excluded", "terms", "host_hit_blocks")
    class TermsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    TERMS_FIELD_NUMBER: _ClassVar[int]
    HOST_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    hit_blocks: int
    cost: float
    excluded: str
    terms: _containers.ScalarMap[str, float]
    host_hit_blocks: int
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., hit_blocks: _Optional[int] = ..., cost: _Optional[float] = ..., excluded: _Optional[str] = ..., terms: _Optional[_Mapping[str, float]] = ..., host_hit_blocks: _Optional[int] = ...) -> None: ...

class ExplainRouteResponse(_message.Message):
    __slots__ = ("policy", "prompt_tokens", "block_hashes", "decode_node", "prefill_node", "local_prefill_reason", "nodes")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_REASON_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    policy: str
    prompt_tokens: int
    block_hashes: _containers.RepeatedScalarFieldContainer[str]
    decode_node: str
    prefill_node: str
    local_prefill_reason: str
    nodes: _containers.RepeatedCompositeFieldContainer[NodeScore]
    def __init__(self, policy: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., block_hashes: _Optional[_Iterable[str]] = ..., decode_node: _Optional[str] = ..., prefill_node: _Optional[str] = ..., local_prefill_reason: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[NodeScore, _Mapping]]] = ...) -> None: ...

class FlushCacheRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class FlushCacheResponse(_message.Message):
    __slots__ = ("blocks_flushed",)
    BLOCKS_FLUSHED_FIELD_NUMBER: _ClassVar[int]
    blocks_flushed: int
    def __init__(self, blocks_flushed: _Optional[int] = ...) -> None: ...

class ListLoRAAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoRAAdapter(_message.Message):
    __slots__ = ("name", "digest", "node_ids", "resident_node_ids")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: str
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    resident_node_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[str] = ..., node_ids: _Optional[_Iterable[str]] = ..., resident_node_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ListLoRAAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoRAAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoRAAdapter, _Mapping]]] = ...) -> None: ...

class LoadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class LoRAAdapterResponse(_message.Message):
    __slots__ = ("adapter", "requests_in_flight")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    adapter: LoRAAdapter
    requests_in_flight: int
    def __init__(self, adapter: _Optional[_Union[LoRAAdapter, _Mapping]] = ..., requests_in_flight: _Optional[int] = ...) -> None: ...
