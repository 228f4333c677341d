import datetime

from arealgrpc.v1 import common_pb2 as _common_pb2
from arealgrpc.v1 import weight_sync_pb2 as _weight_sync_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_PHASE_UNSPECIFIED: _ClassVar[StepPhase]
    STEP_PHASE_RECEIVED: _ClassVar[StepPhase]
    STEP_PHASE_LOGPROBS: _ClassVar[StepPhase]
    STEP_PHASE_UPDATE: _ClassVar[StepPhase]
STEP_PHASE_UNSPECIFIED: StepPhase
STEP_PHASE_RECEIVED: StepPhase
STEP_PHASE_LOGPROBS: StepPhase
STEP_PHASE_UPDATE: StepPhase

class TrainStepRequest(_message.Message):
    __slots__ = ("begin", "group", "end", "trace_context")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    begin: StepBegin
    group: _common_pb2.TrajectoryGroup
    end: StepEnd
    trace_context: _common_pb2.TraceContext
    def __init__(self, begin: _Optional[_Union[StepBegin, _Mapping]] = ..., group: _Optional[_Union[_common_pb2.TrajectoryGroup, _Mapping]] = ..., end: _Optional[_Union[StepEnd, _Mapping]] = ..., trace_context: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ...) -> None: ...

class StepBegin(_message.Message):
    __slots__ = ("global_step", "policy_version", "group_count")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_COUNT_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    policy_version: int
    group_count: int
    def __init__(self, global_step: _Optional[int] = ..., policy_version: _Optional[int] = ..., group_count: _Optional[int] = ...) -> None: ...

class StepEnd(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainStepResponse(_message.Message):
    __slots__ = ("progress", "stats")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    progress: StepProgress
    stats: StepStats
    def __init__(self, progress: _Optional[_Union[StepProgress, _Mapping]] = ..., stats: _Optional[_Union[StepStats, _Mapping]] = ...) -> None: ...

class StepProgress(_message.Message):
    __slots__ = ("microbatches_done", "microbatches_total", "phase")
    MICROBATCHES_DONE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    microbatches_done: int
    microbatches_total: int
    phase: StepPhase
    def __init__(self, microbatches_done: _Optional[int] = ..., microbatches_total: _Optional[int] = ..., phase: _Optional[_Union[StepPhase, str]] = ...) -> None: ...

class StepStats(_message.Message):
    __slots__ = ("global_step", "policy_version", "loss", "grad_norm", "clip_fraction", "entropy", "importance_weight_mean", "importance_weight_max", "reward_mean", "trained_tokens", "sequences", "learning_rate", "elapsed", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    CLIP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    IMPORTANCE_WEIGHT_MEAN_FIELD_NUMBER: _ClassVar[int]
    IMPORTANCE_WEIGHT_MAX_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    TRAINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    policy_version: int
    loss: float
    grad_norm: float
    clip_fraction: float
    entropy: float
    importance_weight_mean: float
    importance_weight_max: float
    reward_mean: float
    trained_tokens: int
    sequences: int
    learning_rate: float
    elapsed: _duration_pb2.Duration
    extra: _containers.ScalarMap[str, float]
    def __init__(self, global_step: _Optional[int] = ..., policy_version: _Optional[int] = ..., loss: _Optional[float] = ..., grad_norm: _Optional[float] = ..., clip_fraction: _Optional[float] = ..., entropy: _Optional[float] = ..., importance_weight_mean: _Optional[float] = ..., importance_weight_max: _Optional[float] = ..., reward_mean: _Optional[float] = ..., trained_tokens: _Optional[int] = ..., sequences: _Optional[int] = ..., learning_rate: _Optional[float] = ..., elapsed: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., extra: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("path", "global_step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    global_step: int
    def __init__(self, path: _Optional[str] = ..., global_step: _Optional[int] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "policy_version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    policy_version: int
    def __init__(self, path: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class LoadCheckpointRequest(_message.Message):
    __slots__ = ("path", "min_policy_version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    min_policy_version: int
    def __init__(self, path: _Optional[str] = ..., min_policy_version: _Optional[int] = ...) -> None: ...

class LoadCheckpointResponse(_message.Message):
    __slots__ = ("global_step", "policy_version")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    policy_version: int
    def __init__(self, global_step: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class ExportModelRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class ExportModelResponse(_message.Message):
    __slots__ = ("path", "policy_version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    policy_version: int
    def __init__(self, path: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class GetTrainerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTrainerStatusResponse(_message.Message):
    __slots__ = ("rank", "world_size", "policy_version", "global_step", "backend", "model", "busy", "ready", "broken_reason")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    BROKEN_REASON_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    policy_version: int
    global_step: int
    backend: _weight_sync_pb2.CollectiveBackend
    model: str
    busy: bool
    ready: bool
    broken_reason: str
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., policy_version: _Optional[int] = ..., global_step: _Optional[int] = ..., backend: _Optional[_Union[_weight_sync_pb2.CollectiveBackend, str]] = ..., model: _Optional[str] = ..., busy: _Optional[bool] = ..., ready: _Optional[bool] = ..., broken_reason: _Optional[str] = ...) -> None: ...

class PublishWeightsRequest(_message.Message):
    __slots__ = ("rollout_addresses", "methods", "bucket_bytes", "timeout")
    ROLLOUT_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    METHODS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    rollout_addresses: _containers.RepeatedScalarFieldContainer[str]
    methods: _containers.RepeatedScalarFieldContainer[_weight_sync_pb2.TransferMethod]
    bucket_bytes: int
    timeout: _duration_pb2.Duration
    def __init__(self, rollout_addresses: _Optional[_Iterable[str]] = ..., methods: _Optional[_Iterable[_Union[_weight_sync_pb2.TransferMethod, str]]] = ..., bucket_bytes: _Optional[int] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class PublishTargetResult(_message.Message):
    __slots__ = ("address", "method", "policy_version", "sent_bytes", "status")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    address: str
    method: _weight_sync_pb2.TransferMethod
    policy_version: int
    sent_bytes: int
    status: _status_pb2.Status
    def __init__(self, address: _Optional[str] = ..., method: _Optional[_Union[_weight_sync_pb2.TransferMethod, str]] = ..., policy_version: _Optional[int] = ..., sent_bytes: _Optional[int] = ..., status: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...

class PublishWeightsResponse(_message.Message):
    __slots__ = ("policy_version", "results", "elapsed", "tensor_count", "total_bytes")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    results: _containers.RepeatedCompositeFieldContainer[PublishTargetResult]
    elapsed: _duration_pb2.Duration
    tensor_count: int
    total_bytes: int
    def __init__(self, policy_version: _Optional[int] = ..., results: _Optional[_Iterable[_Union[PublishTargetResult, _Mapping]]] = ..., elapsed: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., tensor_count: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...
