from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("counts", "seed", "offsets", "model_id")
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    model_id: str
    def __init__(self, counts: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., model_id: _Optional[str] = ...) -> None: ...

class VaryRequest(_message.Message):
    __slots__ = ("images", "labels", "strength", "seed", "first_index", "model_id", "height", "width", "channels")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    STRENGTH_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    images: bytes
    labels: _containers.RepeatedScalarFieldContainer[int]
    strength: float
    seed: int
    first_index: int
    model_id: str
    height: int
    width: int
    channels: int
    def __init__(self, images: _Optional[bytes] = ..., labels: _Optional[_Iterable[int]] = ..., strength: _Optional[float] = ..., seed: _Optional[int] = ..., first_index: _Optional[int] = ..., model_id: _Optional[str] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., channels: _Optional[int] = ...) -> None: ...

class ImageBatch(_message.Message):
    __slots__ = ("images", "labels", "height", "width", "channels", "first_index")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    images: bytes
    labels: _containers.RepeatedScalarFieldContainer[int]
    height: int
    width: int
    channels: int
    first_index: int
    def __init__(self, images: _Optional[bytes] = ..., labels: _Optional[_Iterable[int]] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., channels: _Optional[int] = ..., first_index: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("num_classes", "channels", "height", "width", "model_id", "size", "parameters", "backend", "device", "dtype", "dataset", "ddim_steps", "guidance", "max_request_images", "max_batch")
    NUM_CLASSES_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    DDIM_STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_IMAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    num_classes: int
    channels: int
    height: int
    width: int
    model_id: str
    size: str
    parameters: int
    backend: str
    device: str
    dtype: str
    dataset: str
    ddim_steps: int
    guidance: float
    max_request_images: int
    max_batch: int
    def __init__(self, num_classes: _Optional[int] = ..., channels: _Optional[int] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., model_id: _Optional[str] = ..., size: _Optional[str] = ..., parameters: _Optional[int] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., dataset: _Optional[str] = ..., ddim_steps: _Optional[int] = ..., guidance: _Optional[float] = ..., max_request_images: _Optional[int] = ..., max_batch: _Optional[int] = ...) -> None: ...
