import datetime

from arealgrpc.v1 import common_pb2 as _common_pb2
from arealgrpc.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EpisodeOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EPISODE_OUTCOME_UNSPECIFIED: _ClassVar[EpisodeOutcome]
    EPISODE_OUTCOME_ACCEPTED: _ClassVar[EpisodeOutcome]
    EPISODE_OUTCOME_REJECTED: _ClassVar[EpisodeOutcome]
    EPISODE_OUTCOME_FAILED: _ClassVar[EpisodeOutcome]
    EPISODE_OUTCOME_CANCELLED: _ClassVar[EpisodeOutcome]

class RolloutEngine(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLLOUT_ENGINE_UNSPECIFIED: _ClassVar[RolloutEngine]
    ROLLOUT_ENGINE_HF: _ClassVar[RolloutEngine]
    ROLLOUT_ENGINE_SGLANG: _ClassVar[RolloutEngine]
EPISODE_OUTCOME_UNSPECIFIED: EpisodeOutcome
EPISODE_OUTCOME_ACCEPTED: EpisodeOutcome
EPISODE_OUTCOME_REJECTED: EpisodeOutcome
EPISODE_OUTCOME_FAILED: EpisodeOutcome
EPISODE_OUTCOME_CANCELLED: EpisodeOutcome
ROLLOUT_ENGINE_UNSPECIFIED: RolloutEngine
ROLLOUT_ENGINE_HF: RolloutEngine
ROLLOUT_ENGINE_SGLANG: RolloutEngine

class RunEpisodesRequest(_message.Message):
    __slots__ = ("task", "cancel")
    TASK_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    task: EpisodeTask
    cancel: CancelEpisode
    def __init__(self, task: _Optional[_Union[EpisodeTask, _Mapping]] = ..., cancel: _Optional[_Union[CancelEpisode, _Mapping]] = ...) -> None: ...

class EpisodeTask(_message.Message):
    __slots__ = ("task_id", "data", "workflow", "workflow_params", "group_size", "sampling", "eval", "trace_context", "adapter")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    WORKFLOW_FIELD_NUMBER: _ClassVar[int]
    WORKFLOW_PARAMS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    data: _struct_pb2.Struct
    workflow: str
    workflow_params: _struct_pb2.Struct
    group_size: int
    sampling: _common_pb2.SamplingParams
    eval: bool
    trace_context: _common_pb2.TraceContext
    adapter: str
    def __init__(self, task_id: _Optional[str] = ..., data: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., workflow: _Optional[str] = ..., workflow_params: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., group_size: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., eval: _Optional[bool] = ..., trace_context: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class CancelEpisode(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class RunEpisodesResponse(_message.Message):
    __slots__ = ("task_id", "outcome", "group", "reason", "start_version", "elapsed")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    START_VERSION_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    outcome: EpisodeOutcome
    group: _common_pb2.TrajectoryGroup
    reason: str
    start_version: int
    elapsed: _duration_pb2.Duration
    def __init__(self, task_id: _Optional[str] = ..., outcome: _Optional[_Union[EpisodeOutcome, str]] = ..., group: _Optional[_Union[_common_pb2.TrajectoryGroup, _Mapping]] = ..., reason: _Optional[str] = ..., start_version: _Optional[int] = ..., elapsed: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("input_ids", "sampling", "request_id", "trace_context", "adapter")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    request_id: str
    trace_context: _common_pb2.TraceContext
    adapter: str
    def __init__(self, input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., trace_context: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("output_ids", "output_logprobs", "output_versions", "finish_reason", "output_top_logprobs")
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    output_logprobs: _containers.RepeatedScalarFieldContainer[float]
    output_versions: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    output_top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, output_ids: _Optional[_Iterable[int]] = ..., output_logprobs: _Optional[_Iterable[float]] = ..., output_versions: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., output_top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("completions", "policy_version")
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    policy_version: int
    def __init__(self, completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("input_ids", "sampling", "request_id", "trace_context", "adapter")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    request_id: str
    trace_context: _common_pb2.TraceContext
    adapter: str
    def __init__(self, input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., trace_context: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("output_ids", "output_logprobs", "output_versions", "finish_reason", "output_top_logprobs")
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    output_logprobs: _containers.RepeatedScalarFieldContainer[float]
    output_versions: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    output_top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, output_ids: _Optional[_Iterable[int]] = ..., output_logprobs: _Optional[_Iterable[float]] = ..., output_versions: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., output_top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class PauseGenerationRequest(_message.Message):
    __slots__ = ("return_immediately",)
    RETURN_IMMEDIATELY_FIELD_NUMBER: _ClassVar[int]
    return_immediately: bool
    def __init__(self, return_immediately: _Optional[bool] = ...) -> None: ...

class PauseGenerationResponse(_message.Message):
    __slots__ = ("interrupted_requests", "policy_version")
    INTERRUPTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    interrupted_requests: int
    policy_version: int
    def __init__(self, interrupted_requests: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class ResumeGenerationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeGenerationResponse(_message.Message):
    __slots__ = ("policy_version",)
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    def __init__(self, policy_version: _Optional[int] = ...) -> None: ...

class GetRolloutStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRolloutStatusResponse(_message.Message):
    __slots__ = ("policy_version", "running_requests", "queued_requests", "running_episodes", "paused", "engine", "model", "vocab_size", "generated_tokens", "adapters")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_EPISODES_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    running_requests: int
    queued_requests: int
    running_episodes: int
    paused: bool
    engine: RolloutEngine
    model: str
    vocab_size: int
    generated_tokens: int
    adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, policy_version: _Optional[int] = ..., running_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., running_episodes: _Optional[int] = ..., paused: _Optional[bool] = ..., engine: _Optional[_Union[RolloutEngine, str]] = ..., model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: AdapterHeader
    chunk: _tensor_pb2.TensorChunk
    def __init__(self, header: _Optional[_Union[AdapterHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class AdapterHeader(_message.Message):
    __slots__ = ("name", "rank", "alpha", "tensor_count")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    name: str
    rank: int
    alpha: float
    tensor_count: int
    def __init__(self, name: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., tensor_count: _Optional[int] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("name", "adapter_bytes", "adapted_layers", "replaced")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADAPTED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    name: str
    adapter_bytes: int
    adapted_layers: int
    replaced: bool
    def __init__(self, name: _Optional[str] = ..., adapter_bytes: _Optional[int] = ..., adapted_layers: _Optional[int] = ..., replaced: _Optional[bool] = ...) -> None: ...

class RemoveAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RemoveAdapterResponse(_message.Message):
    __slots__ = ("adapter_bytes",)
    ADAPTER_BYTES_FIELD_NUMBER: _ClassVar[int]
    adapter_bytes: int
    def __init__(self, adapter_bytes: _Optional[int] = ...) -> None: ...
