from arealgrpc.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_METHOD_UNSPECIFIED: _ClassVar[TransferMethod]
    TRANSFER_METHOD_DISTRIBUTED: _ClassVar[TransferMethod]
    TRANSFER_METHOD_STREAM: _ClassVar[TransferMethod]
    TRANSFER_METHOD_DISK: _ClassVar[TransferMethod]
    TRANSFER_METHOD_SOCKET: _ClassVar[TransferMethod]
    TRANSFER_METHOD_SHARED_MEMORY: _ClassVar[TransferMethod]

class CollectiveBackend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COLLECTIVE_BACKEND_UNSPECIFIED: _ClassVar[CollectiveBackend]
    COLLECTIVE_BACKEND_GLOO: _ClassVar[CollectiveBackend]
    COLLECTIVE_BACKEND_NCCL: _ClassVar[CollectiveBackend]
TRANSFER_METHOD_UNSPECIFIED: TransferMethod
TRANSFER_METHOD_DISTRIBUTED: TransferMethod
TRANSFER_METHOD_STREAM: TransferMethod
TRANSFER_METHOD_DISK: TransferMethod
TRANSFER_METHOD_SOCKET: TransferMethod
TRANSFER_METHOD_SHARED_MEMORY: TransferMethod
COLLECTIVE_BACKEND_UNSPECIFIED: CollectiveBackend
COLLECTIVE_BACKEND_GLOO: CollectiveBackend
COLLECTIVE_BACKEND_NCCL: CollectiveBackend

class DistributedParams(_message.Message):
    __slots__ = ("backend", "master_address", "master_port", "world_size", "rank_offset", "group_name", "bucket_bytes", "joined", "device_uuid")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    backend: CollectiveBackend
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int
    group_name: str
    bucket_bytes: int
    joined: bool
    device_uuid: str
    def __init__(self, backend: _Optional[_Union[CollectiveBackend, str]] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank_offset: _Optional[int] = ..., group_name: _Optional[str] = ..., bucket_bytes: _Optional[int] = ..., joined: _Optional[bool] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class StreamParams(_message.Message):
    __slots__ = ("max_chunk_bytes",)
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_chunk_bytes: int
    def __init__(self, max_chunk_bytes: _Optional[int] = ...) -> None: ...

class SocketParams(_message.Message):
    __slots__ = ("host", "port", "token", "max_frame_bytes", "tls")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    token: bytes
    max_frame_bytes: int
    tls: bool
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., token: _Optional[bytes] = ..., max_frame_bytes: _Optional[int] = ..., tls: _Optional[bool] = ...) -> None: ...

class SharedMemoryParams(_message.Message):
    __slots__ = ("root", "probe")
    ROOT_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    root: str
    probe: bytes
    def __init__(self, root: _Optional[str] = ..., probe: _Optional[bytes] = ...) -> None: ...

class DiskParams(_message.Message):
    __slots__ = ("root",)
    ROOT_FIELD_NUMBER: _ClassVar[int]
    root: str
    def __init__(self, root: _Optional[str] = ...) -> None: ...

class TransferOption(_message.Message):
    __slots__ = ("method", "distributed", "stream", "disk", "socket", "shared_memory")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTED_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    method: TransferMethod
    distributed: DistributedParams
    stream: StreamParams
    disk: DiskParams
    socket: SocketParams
    shared_memory: SharedMemoryParams
    def __init__(self, method: _Optional[_Union[TransferMethod, str]] = ..., distributed: _Optional[_Union[DistributedParams, _Mapping]] = ..., stream: _Optional[_Union[StreamParams, _Mapping]] = ..., disk: _Optional[_Union[DiskParams, _Mapping]] = ..., socket: _Optional[_Union[SocketParams, _Mapping]] = ..., shared_memory: _Optional[_Union[SharedMemoryParams, _Mapping]] = ...) -> None: ...

class NegotiateRequest(_message.Message):
    __slots__ = ("offers", "sender_id", "relay")
    OFFERS_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    offers: _containers.RepeatedCompositeFieldContainer[TransferOption]
    sender_id: str
    relay: bool
    def __init__(self, offers: _Optional[_Iterable[_Union[TransferOption, _Mapping]]] = ..., sender_id: _Optional[str] = ..., relay: _Optional[bool] = ...) -> None: ...

class NegotiateResponse(_message.Message):
    __slots__ = ("plan", "policy_version", "plan_id", "weights_dtype", "relay_root", "host_id")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    RELAY_ROOT_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    plan: TransferOption
    policy_version: int
    plan_id: str
    weights_dtype: _tensor_pb2.Dtype
    relay_root: SharedMemoryParams
    host_id: str
    def __init__(self, plan: _Optional[_Union[TransferOption, _Mapping]] = ..., policy_version: _Optional[int] = ..., plan_id: _Optional[str] = ..., weights_dtype: _Optional[_Union[_tensor_pb2.Dtype, str]] = ..., relay_root: _Optional[_Union[SharedMemoryParams, _Mapping]] = ..., host_id: _Optional[str] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushWeightsHeader
    chunk: _tensor_pb2.TensorChunk
    def __init__(self, header: _Optional[_Union[PushWeightsHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class PushWeightsHeader(_message.Message):
    __slots__ = ("plan_id", "policy_version", "tensor_count", "total_bytes")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    policy_version: int
    tensor_count: int
    total_bytes: int
    def __init__(self, plan_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., tensor_count: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
    __slots__ = ("policy_version", "tensor_count", "received_bytes")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    tensor_count: int
    received_bytes: int
    def __init__(self, policy_version: _Optional[int] = ..., tensor_count: _Optional[int] = ..., received_bytes: _Optional[int] = ...) -> None: ...

class UpdateFromDiskRequest(_message.Message):
    __slots__ = ("plan_id", "policy_version", "path")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    policy_version: int
    path: str
    def __init__(self, plan_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class UpdateFromDiskResponse(_message.Message):
    __slots__ = ("policy_version", "tensor_count")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    tensor_count: int
    def __init__(self, policy_version: _Optional[int] = ..., tensor_count: _Optional[int] = ...) -> None: ...

class UpdateFromDistributedRequest(_message.Message):
    __slots__ = ("plan_id", "policy_version", "tensors", "bucket_bytes")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    policy_version: int
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorSpec]
    bucket_bytes: int
    def __init__(self, plan_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorSpec, _Mapping]]] = ..., bucket_bytes: _Optional[int] = ...) -> None: ...

class UpdateFromDistributedResponse(_message.Message):
    __slots__ = ("policy_version", "tensor_count")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    tensor_count: int
    def __init__(self, policy_version: _Optional[int] = ..., tensor_count: _Optional[int] = ...) -> None: ...

class UpdateFromSocketRequest(_message.Message):
    __slots__ = ("plan_id", "policy_version", "tensors")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    policy_version: int
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorSpec]
    def __init__(self, plan_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorSpec, _Mapping]]] = ...) -> None: ...

class UpdateFromSocketResponse(_message.Message):
    __slots__ = ("policy_version", "tensor_count", "received_bytes")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    tensor_count: int
    received_bytes: int
    def __init__(self, policy_version: _Optional[int] = ..., tensor_count: _Optional[int] = ..., received_bytes: _Optional[int] = ...) -> None: ...

class UpdateFromSharedMemoryRequest(_message.Message):
    __slots__ = ("plan_id", "policy_version", "path")
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    plan_id: str
    policy_version: int
    path: str
    def __init__(self, plan_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class UpdateFromSharedMemoryResponse(_message.Message):
    __slots__ = ("policy_version", "tensor_count")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    tensor_count: int
    def __init__(self, policy_version: _Optional[int] = ..., tensor_count: _Optional[int] = ...) -> None: ...
