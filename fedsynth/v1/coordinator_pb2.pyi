from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetRunSpecRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunSpec(_message.Message):
    __slots__ = ("run_id", "config_json", "num_clients")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    NUM_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    config_json: str
    num_clients: int
    def __init__(self, run_id: _Optional[str] = ..., config_json: _Optional[str] = ..., num_clients: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("client_id", "num_samples", "fedeas_images", "missing_classes", "run_id", "synthetic_digest", "label_counts", "schema_digest", "image_channels", "image_size", "unknown_classes", "node_token", "fedsynth_version", "protocol_version", "model_layout_digest", "test_samples")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FEDEAS_IMAGES_FIELD_NUMBER: _ClassVar[int]
    MISSING_CLASSES_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SYNTHETIC_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LABEL_COUNTS_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_DIGEST_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_CLASSES_FIELD_NUMBER: _ClassVar[int]
    NODE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FEDSYNTH_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_LAYOUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TEST_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    num_samples: int
    fedeas_images: int
    missing_classes: _containers.RepeatedScalarFieldContainer[int]
    run_id: str
    synthetic_digest: str
    label_counts: _containers.RepeatedScalarFieldContainer[int]
    schema_digest: str
    image_channels: int
    image_size: int
    unknown_classes: _containers.RepeatedScalarFieldContainer[str]
    node_token: str
    fedsynth_version: str
    protocol_version: int
    model_layout_digest: str
    test_samples: int
    def __init__(self, client_id: _Optional[int] = ..., num_samples: _Optional[int] = ..., fedeas_images: _Optional[int] = ..., missing_classes: _Optional[_Iterable[int]] = ..., run_id: _Optional[str] = ..., synthetic_digest: _Optional[str] = ..., label_counts: _Optional[_Iterable[int]] = ..., schema_digest: _Optional[str] = ..., image_channels: _Optional[int] = ..., image_size: _Optional[int] = ..., unknown_classes: _Optional[_Iterable[str]] = ..., node_token: _Optional[str] = ..., fedsynth_version: _Optional[str] = ..., protocol_version: _Optional[int] = ..., model_layout_digest: _Optional[str] = ..., test_samples: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("session", "completed_rounds", "synthetic_uploaded", "mean_data_wanted", "data_port")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    SYNTHETIC_UPLOADED_FIELD_NUMBER: _ClassVar[int]
    MEAN_DATA_WANTED_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    session: str
    completed_rounds: int
    synthetic_uploaded: bool
    mean_data_wanted: bool
    data_port: int
    def __init__(self, session: _Optional[str] = ..., completed_rounds: _Optional[int] = ..., synthetic_uploaded: _Optional[bool] = ..., mean_data_wanted: _Optional[bool] = ..., data_port: _Optional[int] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("client_id", "session")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    session: str
    def __init__(self, client_id: _Optional[int] = ..., session: _Optional[str] = ...) -> None: ...

class ClientHeartbeat(_message.Message):
    __slots__ = ("client_id", "session")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    session: str
    def __init__(self, client_id: _Optional[int] = ..., session: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("connected",)
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    connected: bool
    def __init__(self, connected: _Optional[bool] = ...) -> None: ...

class Payload(_message.Message):
    __slots__ = ("total_bytes", "sha256", "num_chunks", "xxh3_128")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    XXH3_128_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    sha256: str
    num_chunks: int
    xxh3_128: bytes
    def __init__(self, total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., num_chunks: _Optional[int] = ..., xxh3_128: _Optional[bytes] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("seq", "data")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    seq: int
    data: bytes
    def __init__(self, seq: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("round", "task_id", "deadline_s", "generation_quota", "payload", "data_ticket", "inline_payload", "evaluate")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    GENERATION_QUOTA_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    DATA_TICKET_FIELD_NUMBER: _ClassVar[int]
    INLINE_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_FIELD_NUMBER: _ClassVar[int]
    round: int
    task_id: str
    deadline_s: float
    generation_quota: _containers.RepeatedScalarFieldContainer[int]
    payload: Payload
    data_ticket: bytes
    inline_payload: bytes
    evaluate: bool
    def __init__(self, round: _Optional[int] = ..., task_id: _Optional[str] = ..., deadline_s: _Optional[float] = ..., generation_quota: _Optional[_Iterable[int]] = ..., payload: _Optional[_Union[Payload, _Mapping]] = ..., data_ticket: _Optional[bytes] = ..., inline_payload: _Optional[bytes] = ..., evaluate: _Optional[bool] = ...) -> None: ...

class RunFinished(_message.Message):
    __slots__ = ("reason", "success", "exit_code")
    REASON_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    success: bool
    exit_code: int
    def __init__(self, reason: _Optional[str] = ..., success: _Optional[bool] = ..., exit_code: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("unix_time",)
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    unix_time: float
    def __init__(self, unix_time: _Optional[float] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("task", "chunk", "finished", "heartbeat")
    TASK_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    task: Task
    chunk: Chunk
    finished: RunFinished
    heartbeat: Heartbeat
    def __init__(self, task: _Optional[_Union[Task, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., finished: _Optional[_Union[RunFinished, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class GenerationReport(_message.Message):
    __slots__ = ("images", "wall_seconds", "cache_hit")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    images: int
    wall_seconds: float
    cache_hit: bool
    def __init__(self, images: _Optional[int] = ..., wall_seconds: _Optional[float] = ..., cache_hit: _Optional[bool] = ...) -> None: ...

class UpdateHeader(_message.Message):
    __slots__ = ("client_id", "session", "round", "task_id", "payload", "train_seconds", "train_loss", "num_steps", "train_samples", "generation", "inline_payload")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    INLINE_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    session: str
    round: int
    task_id: str
    payload: Payload
    train_seconds: float
    train_loss: float
    num_steps: int
    train_samples: int
    generation: GenerationReport
    inline_payload: bytes
    def __init__(self, client_id: _Optional[int] = ..., session: _Optional[str] = ..., round: _Optional[int] = ..., task_id: _Optional[str] = ..., payload: _Optional[_Union[Payload, _Mapping]] = ..., train_seconds: _Optional[float] = ..., train_loss: _Optional[float] = ..., num_steps: _Optional[int] = ..., train_samples: _Optional[int] = ..., generation: _Optional[_Union[GenerationReport, _Mapping]] = ..., inline_payload: _Optional[bytes] = ...) -> None: ...

class UpdateChunk(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UpdateHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[UpdateHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RoundSummary(_message.Message):
    __slots__ = ("round", "total_rounds", "accuracy", "loss", "duration_s", "participants", "finished", "success", "message", "exit_code")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    round: int
    total_rounds: int
    accuracy: float
    loss: float
    duration_s: float
    participants: int
    finished: bool
    success: bool
    message: str
    exit_code: int
    def __init__(self, round: _Optional[int] = ..., total_rounds: _Optional[int] = ..., accuracy: _Optional[float] = ..., loss: _Optional[float] = ..., duration_s: _Optional[float] = ..., participants: _Optional[int] = ..., finished: _Optional[bool] = ..., success: _Optional[bool] = ..., message: _Optional[str] = ..., exit_code: _Optional[int] = ...) -> None: ...

class SyntheticHeader(_message.Message):
    __slots__ = ("client_id", "session", "count", "height", "width", "channels", "dtype", "payload", "epsilon", "delta", "noise_multiplier", "gan_seconds")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    GAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    session: str
    count: int
    height: int
    width: int
    channels: int
    dtype: str
    payload: Payload
    epsilon: float
    delta: float
    noise_multiplier: float
    gan_seconds: float
    def __init__(self, client_id: _Optional[int] = ..., session: _Optional[str] = ..., count: _Optional[int] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., channels: _Optional[int] = ..., dtype: _Optional[str] = ..., payload: _Optional[_Union[Payload, _Mapping]] = ..., epsilon: _Optional[float] = ..., delta: _Optional[float] = ..., noise_multiplier: _Optional[float] = ..., gan_seconds: _Optional[float] = ...) -> None: ...

class SyntheticChunk(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: SyntheticHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[SyntheticHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class UploadReply(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    def __init__(self, stored: _Optional[int] = ...) -> None: ...

class MeanDataHeader(_message.Message):
    __slots__ = ("client_id", "session", "count", "height", "width", "channels", "num_classes", "mean_batch", "payload")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    NUM_CLASSES_FIELD_NUMBER: _ClassVar[int]
    MEAN_BATCH_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    session: str
    count: int
    height: int
    width: int
    channels: int
    num_classes: int
    mean_batch: int
    payload: Payload
    def __init__(self, client_id: _Optional[int] = ..., session: _Optional[str] = ..., count: _Optional[int] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., channels: _Optional[int] = ..., num_classes: _Optional[int] = ..., mean_batch: _Optional[int] = ..., payload: _Optional[_Union[Payload, _Mapping]] = ...) -> None: ...

class MeanDataChunk(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: MeanDataHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[MeanDataHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class EvaluationResult(_message.Message):
    __slots__ = ("client_id", "session", "round", "task_id", "examples", "correct", "loss_sum", "class_correct", "class_total", "evaluate_seconds")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    CLASS_CORRECT_FIELD_NUMBER: _ClassVar[int]
    CLASS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    session: str
    round: int
    task_id: str
    examples: int
    correct: int
    loss_sum: float
    class_correct: _containers.RepeatedScalarFieldContainer[int]
    class_total: _containers.RepeatedScalarFieldContainer[int]
    evaluate_seconds: float
    def __init__(self, client_id: _Optional[int] = ..., session: _Optional[str] = ..., round: _Optional[int] = ..., task_id: _Optional[str] = ..., examples: _Optional[int] = ..., correct: _Optional[int] = ..., loss_sum: _Optional[float] = ..., class_correct: _Optional[_Iterable[int]] = ..., class_total: _Optional[_Iterable[int]] = ..., evaluate_seconds: _Optional[float] = ...) -> None: ...

class SetupFailure(_message.Message):
    __slots__ = ("client_id", "session", "reason")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    session: str
    reason: str
    def __init__(self, client_id: _Optional[int] = ..., session: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class SetupFailureReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("client_ids", "reason")
    CLIENT_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    client_ids: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    def __init__(self, client_ids: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, released: _Optional[_Iterable[int]] = ...) -> None: ...

class SecAggKeys(_message.Message):
    __slots__ = ("encryption", "masking")
    ENCRYPTION_FIELD_NUMBER: _ClassVar[int]
    MASKING_FIELD_NUMBER: _ClassVar[int]
    encryption: bytes
    masking: bytes
    def __init__(self, encryption: _Optional[bytes] = ..., masking: _Optional[bytes] = ...) -> None: ...

class SecAggBoxes(_message.Message):
    __slots__ = ("boxes", "seed_commitment")
    class BoxesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: bytes
        def __init__(self, key: _Optional[int] = ..., value: _Optional[bytes] = ...) -> None: ...
    BOXES_FIELD_NUMBER: _ClassVar[int]
    SEED_COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    boxes: _containers.ScalarMap[int, bytes]
    seed_commitment: bytes
    def __init__(self, boxes: _Optional[_Mapping[int, bytes]] = ..., seed_commitment: _Optional[bytes] = ...) -> None: ...

class SecAggUnmaskWait(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SecAggShares(_message.Message):
    __slots__ = ("self_mask", "mask_key")
    class SelfMaskEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: bytes
        def __init__(self, key: _Optional[int] = ..., value: _Optional[bytes] = ...) -> None: ...
    class MaskKeyEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: bytes
        def __init__(self, key: _Optional[int] = ..., value: _Optional[bytes] = ...) -> None: ...
    SELF_MASK_FIELD_NUMBER: _ClassVar[int]
    MASK_KEY_FIELD_NUMBER: _ClassVar[int]
    self_mask: _containers.ScalarMap[int, bytes]
    mask_key: _containers.ScalarMap[int, bytes]
    def __init__(self, self_mask: _Optional[_Mapping[int, bytes]] = ..., mask_key: _Optional[_Mapping[int, bytes]] = ...) -> None: ...

class SecAggRequest(_message.Message):
    __slots__ = ("client_id", "session", "round", "task_id", "keys", "boxes", "unmask_wait", "shares")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BOXES_FIELD_NUMBER: _ClassVar[int]
    UNMASK_WAIT_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    session: str
    round: int
    task_id: str
    keys: SecAggKeys
    boxes: SecAggBoxes
    unmask_wait: SecAggUnmaskWait
    shares: SecAggShares
    def __init__(self, client_id: _Optional[int] = ..., session: _Optional[str] = ..., round: _Optional[int] = ..., task_id: _Optional[str] = ..., keys: _Optional[_Union[SecAggKeys, _Mapping]] = ..., boxes: _Optional[_Union[SecAggBoxes, _Mapping]] = ..., unmask_wait: _Optional[_Union[SecAggUnmaskWait, _Mapping]] = ..., shares: _Optional[_Union[SecAggShares, _Mapping]] = ...) -> None: ...

class SecAggReply(_message.Message):
    __slots__ = ("neighbour_keys", "threshold", "weight", "total_weight", "boxes", "survivors", "dropped", "clients")
    class NeighbourKeysEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: SecAggKeys
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[SecAggKeys, _Mapping]] = ...) -> None: ...
    NEIGHBOUR_KEYS_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    BOXES_FIELD_NUMBER: _ClassVar[int]
    SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    neighbour_keys: _containers.MessageMap[int, SecAggKeys]
    threshold: int
    weight: int
    total_weight: int
    boxes: SecAggBoxes
    survivors: _containers.RepeatedScalarFieldContainer[int]
    dropped: _containers.RepeatedScalarFieldContainer[int]
    clients: int
    def __init__(self, neighbour_keys: _Optional[_Mapping[int, SecAggKeys]] = ..., threshold: _Optional[int] = ..., weight: _Optional[int] = ..., total_weight: _Optional[int] = ..., boxes: _Optional[_Union[SecAggBoxes, _Mapping]] = ..., survivors: _Optional[_Iterable[int]] = ..., dropped: _Optional[_Iterable[int]] = ..., clients: _Optional[int] = ...) -> None: ...
