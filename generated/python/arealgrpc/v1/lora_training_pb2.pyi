import datetime

from arealgrpc.v1 import common_pb2 as _common_pb2
from arealgrpc.v1 import rollout_pb2 as _rollout_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CheckpointKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKPOINT_KIND_UNSPECIFIED: _ClassVar[CheckpointKind]
    CHECKPOINT_KIND_STATE: _ClassVar[CheckpointKind]
    CHECKPOINT_KIND_SAMPLER: _ClassVar[CheckpointKind]

class LossFunction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOSS_FUNCTION_UNSPECIFIED: _ClassVar[LossFunction]
    LOSS_FUNCTION_CROSS_ENTROPY: _ClassVar[LossFunction]
    LOSS_FUNCTION_IMPORTANCE_SAMPLING: _ClassVar[LossFunction]
    LOSS_FUNCTION_PPO: _ClassVar[LossFunction]
    LOSS_FUNCTION_CISPO: _ClassVar[LossFunction]
    LOSS_FUNCTION_DRO: _ClassVar[LossFunction]
CHECKPOINT_KIND_UNSPECIFIED: CheckpointKind
CHECKPOINT_KIND_STATE: CheckpointKind
CHECKPOINT_KIND_SAMPLER: CheckpointKind
LOSS_FUNCTION_UNSPECIFIED: LossFunction
LOSS_FUNCTION_CROSS_ENTROPY: LossFunction
LOSS_FUNCTION_IMPORTANCE_SAMPLING: LossFunction
LOSS_FUNCTION_PPO: LossFunction
LOSS_FUNCTION_CISPO: LossFunction
LOSS_FUNCTION_DRO: LossFunction

class BaseModel(_message.Message):
    __slots__ = ("name", "max_context_length", "trainable", "sampleable", "tokenizer_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLEABLE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_context_length: int
    trainable: bool
    sampleable: bool
    tokenizer_id: str
    def __init__(self, name: _Optional[str] = ..., max_context_length: _Optional[int] = ..., trainable: _Optional[bool] = ..., sampleable: _Optional[bool] = ..., tokenizer_id: _Optional[str] = ...) -> None: ...

class ListBaseModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListBaseModelsResponse(_message.Message):
    __slots__ = ("base_models",)
    BASE_MODELS_FIELD_NUMBER: _ClassVar[int]
    base_models: _containers.RepeatedCompositeFieldContainer[BaseModel]
    def __init__(self, base_models: _Optional[_Iterable[_Union[BaseModel, _Mapping]]] = ...) -> None: ...

class LoraSpec(_message.Message):
    __slots__ = ("rank", "train_attn", "train_mlp", "train_unembed", "seed")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ATTN_FIELD_NUMBER: _ClassVar[int]
    TRAIN_MLP_FIELD_NUMBER: _ClassVar[int]
    TRAIN_UNEMBED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    train_attn: bool
    train_mlp: bool
    train_unembed: bool
    seed: int
    def __init__(self, rank: _Optional[int] = ..., train_attn: _Optional[bool] = ..., train_mlp: _Optional[bool] = ..., train_unembed: _Optional[bool] = ..., seed: _Optional[int] = ...) -> None: ...

class TrainingRun(_message.Message):
    __slots__ = ("name", "base_model", "lora", "steps", "last_sequence_number", "checkpoints", "last_request_time", "adapter_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    LAST_REQUEST_TIME_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    base_model: str
    lora: LoraSpec
    steps: int
    last_sequence_number: int
    checkpoints: _containers.RepeatedCompositeFieldContainer[Checkpoint]
    last_request_time: _timestamp_pb2.Timestamp
    adapter_bytes: int
    def __init__(self, name: _Optional[str] = ..., base_model: _Optional[str] = ..., lora: _Optional[_Union[LoraSpec, _Mapping]] = ..., steps: _Optional[int] = ..., last_sequence_number: _Optional[int] = ..., checkpoints: _Optional[_Iterable[_Union[Checkpoint, _Mapping]]] = ..., last_request_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., adapter_bytes: _Optional[int] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("name", "kind", "size_bytes", "create_time", "step", "lora", "base_model")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: CheckpointKind
    size_bytes: int
    create_time: _timestamp_pb2.Timestamp
    step: int
    lora: LoraSpec
    base_model: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[CheckpointKind, str]] = ..., size_bytes: _Optional[int] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., step: _Optional[int] = ..., lora: _Optional[_Union[LoraSpec, _Mapping]] = ..., base_model: _Optional[str] = ...) -> None: ...

class CreateTrainingRunRequest(_message.Message):
    __slots__ = ("base_model", "lora", "training_run_id")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    lora: LoraSpec
    training_run_id: str
    def __init__(self, base_model: _Optional[str] = ..., lora: _Optional[_Union[LoraSpec, _Mapping]] = ..., training_run_id: _Optional[str] = ...) -> None: ...

class CreateTrainingRunResponse(_message.Message):
    __slots__ = ("operation",)
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    operation: Operation
    def __init__(self, operation: _Optional[_Union[Operation, _Mapping]] = ...) -> None: ...

class GetTrainingRunRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetTrainingRunResponse(_message.Message):
    __slots__ = ("training_run",)
    TRAINING_RUN_FIELD_NUMBER: _ClassVar[int]
    training_run: TrainingRun
    def __init__(self, training_run: _Optional[_Union[TrainingRun, _Mapping]] = ...) -> None: ...

class ListTrainingRunsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTrainingRunsResponse(_message.Message):
    __slots__ = ("training_runs",)
    TRAINING_RUNS_FIELD_NUMBER: _ClassVar[int]
    training_runs: _containers.RepeatedCompositeFieldContainer[TrainingRun]
    def __init__(self, training_runs: _Optional[_Iterable[_Union[TrainingRun, _Mapping]]] = ...) -> None: ...

class DeleteTrainingRunRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteTrainingRunResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LossConfig(_message.Message):
    __slots__ = ("clip_low_threshold", "clip_high_threshold", "beta")
    CLIP_LOW_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    CLIP_HIGH_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    clip_low_threshold: float
    clip_high_threshold: float
    beta: float
    def __init__(self, clip_low_threshold: _Optional[float] = ..., clip_high_threshold: _Optional[float] = ..., beta: _Optional[float] = ...) -> None: ...

class Datum(_message.Message):
    __slots__ = ("input_tokens", "target_tokens", "weights", "logprobs", "advantages")
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    input_tokens: _containers.RepeatedScalarFieldContainer[int]
    target_tokens: _containers.RepeatedScalarFieldContainer[int]
    weights: _containers.RepeatedScalarFieldContainer[float]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    advantages: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, input_tokens: _Optional[_Iterable[int]] = ..., target_tokens: _Optional[_Iterable[int]] = ..., weights: _Optional[_Iterable[float]] = ..., logprobs: _Optional[_Iterable[float]] = ..., advantages: _Optional[_Iterable[float]] = ...) -> None: ...

class ForwardBackwardRequest(_message.Message):
    __slots__ = ("training_run", "data", "loss_function", "loss_config", "forward_only", "sequence_number")
    TRAINING_RUN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LOSS_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    LOSS_CONFIG_FIELD_NUMBER: _ClassVar[int]
    FORWARD_ONLY_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    training_run: str
    data: _containers.RepeatedCompositeFieldContainer[Datum]
    loss_function: LossFunction
    loss_config: LossConfig
    forward_only: bool
    sequence_number: int
    def __init__(self, training_run: _Optional[str] = ..., data: _Optional[_Iterable[_Union[Datum, _Mapping]]] = ..., loss_function: _Optional[_Union[LossFunction, str]] = ..., loss_config: _Optional[_Union[LossConfig, _Mapping]] = ..., forward_only: _Optional[bool] = ..., sequence_number: _Optional[int] = ...) -> None: ...

class ForwardBackwardResponse(_message.Message):
    __slots__ = ("operation",)
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    operation: Operation
    def __init__(self, operation: _Optional[_Union[Operation, _Mapping]] = ...) -> None: ...

class DatumOutput(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ForwardBackwardResult(_message.Message):
    __slots__ = ("outputs", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[DatumOutput]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, outputs: _Optional[_Iterable[_Union[DatumOutput, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class AdamParams(_message.Message):
    __slots__ = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., grad_clip_norm: _Optional[float] = ...) -> None: ...

class OptimStepRequest(_message.Message):
    __slots__ = ("training_run", "adam", "sequence_number")
    TRAINING_RUN_FIELD_NUMBER: _ClassVar[int]
    ADAM_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    training_run: str
    adam: AdamParams
    sequence_number: int
    def __init__(self, training_run: _Optional[str] = ..., adam: _Optional[_Union[AdamParams, _Mapping]] = ..., sequence_number: _Optional[int] = ...) -> None: ...

class OptimStepResponse(_message.Message):
    __slots__ = ("operation",)
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    operation: Operation
    def __init__(self, operation: _Optional[_Union[Operation, _Mapping]] = ...) -> None: ...

class OptimStepResult(_message.Message):
    __slots__ = ("metrics",)
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SaveWeightsRequest(_message.Message):
    __slots__ = ("training_run", "checkpoint_id", "kind", "sequence_number")
    TRAINING_RUN_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    training_run: str
    checkpoint_id: str
    kind: CheckpointKind
    sequence_number: int
    def __init__(self, training_run: _Optional[str] = ..., checkpoint_id: _Optional[str] = ..., kind: _Optional[_Union[CheckpointKind, str]] = ..., sequence_number: _Optional[int] = ...) -> None: ...

class SaveWeightsResponse(_message.Message):
    __slots__ = ("operation",)
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    operation: Operation
    def __init__(self, operation: _Optional[_Union[Operation, _Mapping]] = ...) -> None: ...

class GetCheckpointRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetCheckpointResponse(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: Checkpoint
    def __init__(self, checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("training_run", "checkpoint", "with_optimizer", "sequence_number")
    TRAINING_RUN_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    WITH_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    training_run: str
    checkpoint: str
    with_optimizer: bool
    sequence_number: int
    def __init__(self, training_run: _Optional[str] = ..., checkpoint: _Optional[str] = ..., with_optimizer: _Optional[bool] = ..., sequence_number: _Optional[int] = ...) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ("operation",)
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    operation: Operation
    def __init__(self, operation: _Optional[_Union[Operation, _Mapping]] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("checkpoint", "base_model", "prompt_tokens", "sampling", "stop", "prompt_logprobs")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    checkpoint: str
    base_model: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    prompt_logprobs: bool
    def __init__(self, checkpoint: _Optional[str] = ..., base_model: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., prompt_logprobs: _Optional[bool] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("operation",)
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    operation: Operation
    def __init__(self, operation: _Optional[_Union[Operation, _Mapping]] = ...) -> None: ...

class SampleResult(_message.Message):
    __slots__ = ("completions", "prompt_logprobs")
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[_rollout_pb2.Completion]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, completions: _Optional[_Iterable[_Union[_rollout_pb2.Completion, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Operation(_message.Message):
    __slots__ = ("name", "done", "error", "training_run", "forward_backward", "optim_step", "checkpoint", "sample", "queue_position")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRAINING_RUN_FIELD_NUMBER: _ClassVar[int]
    FORWARD_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    OPTIM_STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    name: str
    done: bool
    error: _status_pb2.Status
    training_run: TrainingRun
    forward_backward: ForwardBackwardResult
    optim_step: OptimStepResult
    checkpoint: Checkpoint
    sample: SampleResult
    queue_position: int
    def __init__(self, name: _Optional[str] = ..., done: _Optional[bool] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., training_run: _Optional[_Union[TrainingRun, _Mapping]] = ..., forward_backward: _Optional[_Union[ForwardBackwardResult, _Mapping]] = ..., optim_step: _Optional[_Union[OptimStepResult, _Mapping]] = ..., checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., sample: _Optional[_Union[SampleResult, _Mapping]] = ..., queue_position: _Optional[int] = ...) -> None: ...

class GetOperationRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetOperationResponse(_message.Message):
    __slots__ = ("operation",)
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    operation: Operation
    def __init__(self, operation: _Optional[_Union[Operation, _Mapping]] = ...) -> None: ...

class WaitOperationRequest(_message.Message):
    __slots__ = ("name", "timeout")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    timeout: _duration_pb2.Duration
    def __init__(self, name: _Optional[str] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class WaitOperationResponse(_message.Message):
    __slots__ = ("operation",)
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    operation: Operation
    def __init__(self, operation: _Optional[_Union[Operation, _Mapping]] = ...) -> None: ...
