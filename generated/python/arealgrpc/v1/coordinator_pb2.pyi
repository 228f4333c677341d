import datetime

from arealgrpc.v1 import common_pb2 as _common_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_ROLLOUT: _ClassVar[WorkerRole]
    WORKER_ROLE_TRAINER: _ClassVar[WorkerRole]

class RolloutServerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLLOUT_SERVER_STATE_UNSPECIFIED: _ClassVar[RolloutServerState]
    ROLLOUT_SERVER_STATE_SERVING: _ClassVar[RolloutServerState]
    ROLLOUT_SERVER_STATE_JOINING: _ClassVar[RolloutServerState]
    ROLLOUT_SERVER_STATE_DOWN: _ClassVar[RolloutServerState]
    ROLLOUT_SERVER_STATE_RESTARTING: _ClassVar[RolloutServerState]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_ROLLOUT: WorkerRole
WORKER_ROLE_TRAINER: WorkerRole
ROLLOUT_SERVER_STATE_UNSPECIFIED: RolloutServerState
ROLLOUT_SERVER_STATE_SERVING: RolloutServerState
ROLLOUT_SERVER_STATE_JOINING: RolloutServerState
ROLLOUT_SERVER_STATE_DOWN: RolloutServerState
ROLLOUT_SERVER_STATE_RESTARTING: RolloutServerState

class AcquireRolloutRequest(_message.Message):
    __slots__ = ("producer_id", "group_size", "trace_context")
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    producer_id: str
    group_size: int
    trace_context: _common_pb2.TraceContext
    def __init__(self, producer_id: _Optional[str] = ..., group_size: _Optional[int] = ..., trace_context: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ...) -> None: ...

class RolloutLease(_message.Message):
    __slots__ = ("lease_id", "policy_version", "deadline", "group_size", "rollout_address", "trace_context")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    policy_version: int
    deadline: _timestamp_pb2.Timestamp
    group_size: int
    rollout_address: str
    trace_context: _common_pb2.TraceContext
    def __init__(self, lease_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., group_size: _Optional[int] = ..., rollout_address: _Optional[str] = ..., trace_context: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ...) -> None: ...

class AcquireRolloutResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: RolloutLease
    def __init__(self, lease: _Optional[_Union[RolloutLease, _Mapping]] = ...) -> None: ...

class ReleaseRolloutRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseRolloutResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RenewRolloutRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class RenewRolloutResponse(_message.Message):
    __slots__ = ("deadline",)
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    deadline: _timestamp_pb2.Timestamp
    def __init__(self, deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class SubmitTrajectoriesRequest(_message.Message):
    __slots__ = ("lease_id", "group")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    group: _common_pb2.TrajectoryGroup
    def __init__(self, lease_id: _Optional[str] = ..., group: _Optional[_Union[_common_pb2.TrajectoryGroup, _Mapping]] = ...) -> None: ...

class SubmissionRejection(_message.Message):
    __slots__ = ("lease_id", "reason")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    reason: str
    def __init__(self, lease_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class SubmitTrajectoriesResponse(_message.Message):
    __slots__ = ("accepted_groups", "rejections")
    ACCEPTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    accepted_groups: int
    rejections: _containers.RepeatedCompositeFieldContainer[SubmissionRejection]
    def __init__(self, accepted_groups: _Optional[int] = ..., rejections: _Optional[_Iterable[_Union[SubmissionRejection, _Mapping]]] = ...) -> None: ...

class WatchVersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchVersionResponse(_message.Message):
    __slots__ = ("policy_version", "global_step")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    global_step: int
    def __init__(self, policy_version: _Optional[int] = ..., global_step: _Optional[int] = ...) -> None: ...

class GetCoordinatorStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "healthy", "policy_version", "rollout_state", "restarts")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_STATE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    address: str
    healthy: bool
    policy_version: int
    rollout_state: RolloutServerState
    restarts: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., policy_version: _Optional[int] = ..., rollout_state: _Optional[_Union[RolloutServerState, str]] = ..., restarts: _Optional[int] = ...) -> None: ...

class GetCoordinatorStatusResponse(_message.Message):
    __slots__ = ("policy_version", "global_step", "running", "accepted", "rejected", "capacity", "max_staleness", "batch_size", "workers", "rollout_restarts")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    global_step: int
    running: int
    accepted: int
    rejected: int
    capacity: int
    max_staleness: int
    batch_size: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    rollout_restarts: int
    def __init__(self, policy_version: _Optional[int] = ..., global_step: _Optional[int] = ..., running: _Optional[int] = ..., accepted: _Optional[int] = ..., rejected: _Optional[int] = ..., capacity: _Optional[int] = ..., max_staleness: _Optional[int] = ..., batch_size: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., rollout_restarts: _Optional[int] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("role", "address", "worker_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    role: WorkerRole
    address: str
    worker_id: str
    def __init__(self, role: _Optional[_Union[WorkerRole, str]] = ..., address: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("worker_id", "policy_version")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    policy_version: int
    def __init__(self, worker_id: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DeregisterWorkerResponse(_message.Message):
    __slots__ = ("requeued_tasks",)
    REQUEUED_TASKS_FIELD_NUMBER: _ClassVar[int]
    requeued_tasks: int
    def __init__(self, requeued_tasks: _Optional[int] = ...) -> None: ...

class ScaleRolloutFleetRequest(_message.Message):
    __slots__ = ("servers",)
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    servers: int
    def __init__(self, servers: _Optional[int] = ...) -> None: ...

class ScaleRolloutFleetResponse(_message.Message):
    __slots__ = ("added", "removed", "requeued_tasks", "servers", "policy_version")
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    REQUEUED_TASKS_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    added: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    removed: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    requeued_tasks: int
    servers: int
    policy_version: int
    def __init__(self, added: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., removed: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., requeued_tasks: _Optional[int] = ..., servers: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...
