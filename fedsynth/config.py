"""The run configuration: frozen, validated dataclasses read from TOML, with `section.key=value` overrides."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import string
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from fedsynth.config_schema import (
    ACCOUNTANTS,
    AGGREGATION_PARAMS,
    AGGREGATIONS,
    LR_SCHEDULES,
    OPTIMIZERS,
    PRECISIONS,
    ALGORITHM_PARAMS,
    ALGORITHMS,
    BUILTIN_SCHEMAS,
    DATA_SOURCES,
    DATASETS,
    DATA_PLANES,
    DP_LEVELS,
    EVALUATIONS,
    GENERATOR_BACKENDS,
    GENERATOR_SIZES,
    MAX_EXPONENT,
    MAX_PORT,
    CLASSIFIER_MODELS,
    PARTITIONS,
    POLICIES,
    UNET_MODELS,
    PE_MODEL,
    EMBEDDERS,
    UPDATE_NORM_ACTIONS,
    WIRE_DTYPES,
    Section,
)
from fedsynth.errors import ConfigError

PAPER_RULE = {"exponent": 0.5, "entropy_factor": True}  # FedEAS's b_k as the paper defines it (the defaults below)
# Keys that came later (text2image's, the quality filter's): at these defaults, old fingerprints hold.
LATER_GENERATION_KEYS = {"prompt_template": "a photo of a {name}", "class_names_file": None, "min_confidence": 0.0}
DEFAULT_PROMPT_TEMPLATE = LATER_GENERATION_KEYS["prompt_template"]
# Federated evaluation's keys (docs/evaluation.md): at these defaults (the coordinator tests alone), old fingerprints hold.
LATER_EVALUATION_KEYS = {"data": {"local_test_fraction": 0.0}, "train": {"evaluation": "server", "eval_every": 1, "fraction_evaluate": 1.0}}
# runtime's bounded-update keys (coordinator.update_norms): with the bound off they change nothing, and a set bound
# enters the fingerprint (clipping changes results) only then, so old fingerprints hold.
UPDATE_NORM_KEYS = ("max_update_norm", "max_update_norm_factor", "update_norm_action")
# Local data's keys came later too: at these defaults (split mode, the dataset's built-in schema), old fingerprints hold.
LATER_DATA_KEYS = {"source": "split", "classes": None, "image_size": None, "channels": None}
# Keys that came with fedsynth 0.2.0 (untrusted members, bring-your-own model and hardware), by section, at the
# defaults that change nothing a run computes: left out of the fingerprint there, and out of the run spec a coordinator
# sends (a node of the release before them then parses it and is refused by its version, by name, instead of failing
# on an unknown key).
RELEASE_0_2_KEYS = {
    "data": {"max_image_pixels": 1 << 24, "follow_symlinks": False},
    "train": {"aggregation": "mean", "aggregation_params": {}, "device": "cpu", "precision": "fp32", "optimizer": "sgd",
              "lr_schedule": "constant", "init_weights": None, "dp": "none", "dp_clip": 1.0, "noise_multiplier": None,
              "target_epsilon": None, "dp_delta": 1e-5, "dp_accountant": "rdp"},
    "runtime": {"max_refusals": 3},
}
MAX_SEED = 2**32 - 1  # torch, numpy and the derived per-client seeds all take it


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class DataConfig(Section):
    """The dataset and how it is split among the clients."""

    SECTION: ClassVar[str] = "data"
    dataset: str = "digits"  # digits is embedded (no download); cifar10/cifar100/npz read data_dir
    data_dir: str | None = None  # the dataset's folder (npz: train.npz and test.npz)
    download: bool = False  # let torchvision download CIFAR into data_dir when it is missing there
    clients: int = 10  # K, the number of clients the training split is divided among
    partition: str = "dirichlet"  # how labels are split: Dirichlet(alpha) label skew, or iid
    alpha: float = 0.1  # the Dirichlet concentration: smaller is more skewed (the paper: 0.05, 0.1, 0.3)
    min_size: int = 10  # the Dirichlet split is redrawn until every client holds at least this many samples
    holdout_fraction: float = 0.0  # share of each class set aside before partitioning (the holdout backend serves it)
    # The share of each client's shard it keeps out of training to test the global model on (federated evaluation);
    # 0 with train.evaluation = "federated" or "both" means fedsynth.learning.evaluation.DEFAULT_LOCAL_TEST_FRACTION.
    local_test_fraction: float = 0.0
    # A registration reporting more samples than this (N_k, the client's aggregation weight) is refused; 0 = no limit.
    # It decides who may join, not what a joined client computes: left out of the fingerprint.
    max_samples_per_client: int = 0
    # "split": each client cuts its shard of `dataset` by the seeded split above; "local": each client node loads its
    # own folder (`fedsynth client --data`; the launcher passes `local_dir`/client-<k>) and the coordinator holds none.
    source: str = "split"
    local_dir: str | None = None  # the launcher's folder of client-<k>/ folders (`fedsynth data split --out`)
    # Local mode: the coordinator's own test data (<class name>/ folders of images, directly or under test/, or an
    # .npz), for server evaluation; without it the coordinator holds no data and the clients evaluate (federated).
    test_dir: str | None = None
    # The federation's class names in label order; a client folder's class folders are matched to them by name. Left
    # out, the built-in dataset's ("0".."9" for digits; CIFAR's names).
    classes: tuple[str, ...] | None = None
    # The side, in pixels, of the square images every model sees: local mode resizes each client's square images to it
    # (bilinear); a generator must make images of this size (checked before any process starts). Left out, the built-in
    # dataset's (digits 8, CIFAR 32).
    image_size: int | None = None
    # 1 (grayscale) or 3 (RGB): the models' input channels; a client whose images have the other count is refused by
    # name. Left out, the built-in dataset's (digits 1, CIFAR 3).
    channels: int | None = None
    # Local data: an image whose header declares more pixels (width x height) than this is refused by name before
    # it is decoded (a small PNG can declare 13,000 x 13,000: ~484 MiB decoded).
    max_image_pixels: int = 1 << 24
    # Local data: files or folders reached through a symbolic link that leaves the client folder are refused by name,
    # unless this is true.
    follow_symlinks: bool = False

    def check(self) -> None:
        self.one_of("dataset", DATASETS)
        self.at_least(1, "max_image_pixels")
        self.non_empty("data_dir", "local_dir", "test_dir")
        if self.test_dir is not None and self.source != "local":
            raise ConfigError(f"data.test_dir is the coordinator's test data in local mode (data.source = \"local\"); "
                              f"split mode tests on the dataset's own test split, got data.test_dir={self.test_dir!r}")
        self.at_least(1, "clients")
        self.one_of("partition", PARTITIONS)
        self.above(0, "alpha")
        self.at_least(0, "min_size")
        self.within("holdout_fraction", 0, 1, high_open=True)
        self.within("local_test_fraction", 0, 1, high_open=True)
        self.at_least(0, "max_samples_per_client")
        self.one_of("source", DATA_SOURCES)
        self.at_least(1, "image_size")
        if self.channels is not None and self.channels not in (1, 3):
            self._fail("channels", "1 (grayscale) or 3 (RGB)")
        if self.classes is not None:
            if len(self.classes) < 2:
                self._fail("classes", "a list of at least 2 class names")
            for name in self.classes:
                if not name.strip() or name != name.strip() or "/" in name or "\\" in name or name in (".", ".."):
                    raise ConfigError(f"data.classes: {name!r} is not a usable class name (a folder name: no slashes, "
                                      "no surrounding spaces)")
            if len(set(self.classes)) < len(self.classes):
                raise ConfigError(f"data.classes names a class twice: {list(self.classes)!r}")
        if self.source == "local" and self.dataset not in BUILTIN_SCHEMAS:
            for name in ("classes", "image_size", "channels"):
                if getattr(self, name) is None:
                    raise ConfigError(f"data.{name} must be set when data.source = \"local\" and data.dataset = "
                                      f"{self.dataset!r} (only {', '.join(BUILTIN_SCHEMAS)} bring a built-in schema)")

    def schema(self) -> tuple[tuple[str, ...] | None, int | None, int | None]:
        """(classes, image_size, channels): the keys given, else the built-in dataset's (None where npz has none)."""
        builtin = BUILTIN_SCHEMAS.get(self.dataset, (None, None, None))
        given = (self.classes, self.image_size, self.channels)
        return tuple(mine if mine is not None else theirs for mine, theirs in zip(given, builtin))  # type: ignore[return-value]


@dataclass(frozen=True)
class TrainConfig(Section):
    """The model, the federated algorithm and local training."""

    SECTION: ClassVar[str] = "train"
    # The global model (docs/guides/bring-your-own-model.md): "cnn" (a small CNN), "resnet18" (the CIFAR ResNet-18),
    # "torchvision:<builder>" (a classification builder of torchvision.models, weights=None, num_classes from the
    # schema) or "package.module:factory" (factory(num_classes, channels, image_size) -> torch.nn.Module, installed on
    # every node); data.image_size and data.channels are its input.
    model: str = "cnn"
    algorithm: str = "fedavg"  # the federated algorithm (docs/algorithms.md); FedEAS is generation.policy
    rounds: int = 20  # T, communication rounds
    fraction: float = 1.0  # share of the clients sampled each round
    lr: float = 0.05  # clients' SGD learning rate
    momentum: float = 0.9  # clients' SGD momentum
    weight_decay: float = 0.0  # clients' SGD weight decay
    batch_size: int = 32  # local training batch size
    local_epochs: int = 5  # E, passes over a client's (real + synthetic) data each round
    max_steps: int | None = None  # cap on a client's optimizer steps a round (0: training off, for benchmarks)
    augment: bool = False  # random crop and horizontal flip of local training batches
    eval_batch_size: int = 512  # batch size of the coordinator's test pass
    evaluation: str = "server"  # "server": the coordinator's test set; "federated": the clients' local test sets; "both"
    eval_every: int = 1  # federated evaluation after every eval_every-th round (and after the last)
    fraction_evaluate: float = 1.0  # the share of the K clients sampled (seeded, per round) to evaluate
    algorithm_params: dict[str, int | float] = field(default_factory=dict)  # the algorithm's parameters by name
    # Where training runs (clients' local training, the coordinator's test pass, SDA-FL's server steps, FedGen's
    # generator): "auto" (a GPU when the process has one, else the CPU), "cpu", "cuda" or "cuda:N".
    device: str = "cpu"
    precision: str = "fp32"  # "bf16" / "fp16": autocast on a GPU (fp16 with a GradScaler); fp32 everywhere by default
    optimizer: str = "sgd"  # the clients' local optimizer, fresh each round: sgd (lr, momentum, weight_decay), adam, adamw
    lr_schedule: str = "constant"  # the clients' lr over rounds: constant, cosine (to 0 at the last round), step (x0.1 at 1/2, 3/4)
    # A safetensors file of the built model's initial weights (its state_dict's names and shapes, strictly): read by the
    # coordinator alone, which records its SHA-256 in coordinator.json and sends it as round 1's global model (clients
    # need no copy); None: seeded random initialisation.
    init_weights: str | None = None
    # How the round's updates become the new global model: the N_k-weighted mean, or a robust rule (docs/security.md):
    # the coordinate-wise median, the trimmed mean, Krum or Multi-Krum. The robust rules hold the round's updates.
    aggregation: str = "mean"
    aggregation_params: dict[str, int | float] = field(default_factory=dict)  # the rule's parameters by name
    # User-level differential privacy of the model (DP-FedAvg; docs/privacy.md): "none", or "user" (each client's whole
    # data): every update clipped to dp_clip, Gaussian noise of noise_multiplier x dp_clip on the sum.
    dp: str = "none"
    dp_clip: float = 1.0  # S: the L2 bound of a client's update (its move from the global model), on client and server
    noise_multiplier: float | None = None  # sigma; None: the smallest that keeps target_epsilon over train.rounds
    target_epsilon: float | None = None  # the budget: picks sigma (noise_multiplier unset), else the run ends before passing it
    dp_delta: float = 1e-5  # the delta epsilon is accounted at (at most 1/K is meaningful: docs/privacy.md)
    dp_accountant: str = "rdp"  # Opacus's accountant: rdp or prv

    def check(self) -> None:
        if not (self.device in ("auto", "cpu", "cuda") or (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            self._fail("device", '"auto", "cpu", "cuda" or "cuda:N"')
        self.one_of("precision", PRECISIONS)
        self.one_of("optimizer", OPTIMIZERS)
        self.one_of("lr_schedule", LR_SCHEDULES)
        self.non_empty("init_weights")
        self.one_of("aggregation", AGGREGATIONS)
        self.parameters_of(self.aggregation, "aggregation_params", AGGREGATION_PARAMS)
        self.model_spec("model", CLASSIFIER_MODELS, internal=(*UNET_MODELS, PE_MODEL))
        self.one_of("algorithm", ALGORITHMS)
        self.at_least(1, "rounds", "batch_size", "local_epochs", "eval_batch_size")
        self.within("fraction", 0, 1, low_open=True)
        self.one_of("evaluation", EVALUATIONS)
        self.at_least(1, "eval_every")
        self.within("fraction_evaluate", 0, 1, low_open=True)
        self.above(0, "lr")
        self.within("momentum", 0, 1, high_open=True)
        self.at_least(0, "weight_decay", "max_steps")
        self.parameters_of(self.algorithm, "algorithm_params")
        self.one_of("dp", ("none", "user"))
        self.above(0, "dp_clip", "target_epsilon")
        self.at_least(0, "noise_multiplier")
        self.within("dp_delta", 0, 1, low_open=True, high_open=True)
        self.one_of("dp_accountant", ACCOUNTANTS)
        if self.dp == "user" and self.noise_multiplier is None and self.target_epsilon is None:
            raise ConfigError("train.dp = \"user\" needs train.target_epsilon (sigma is picked for it) or train.noise_multiplier")


@dataclass(frozen=True)
class GenerationConfig(Section):
    """Synthetic data: the allocation policy (where to generate) and the generator that draws the images."""

    SECTION: ClassVar[str] = "generation"
    policy: str = "fedeas"  # where to generate: FedEAS (the default), a matched baseline, or none (plain FL)
    beta: float = 12.0  # FedEAS's budget scale in b_k (the paper: 12)
    budget: int | None = None  # uniform / missing: total images B (unset: matched to FedEAS's total at beta)
    backend: str = "ddpm"  # what the generator serves: a trained DDPM, real held-out images, or a text2image pipeline
    model_dir: str | None = None  # ddpm: a trained folder (None: train on first use); text2image: a saved pipeline
    # A running generator: HOST:PORT, replicas as HOST:PORT,HOST:PORT,... (requests sharded across them), or
    # dns:///NAME:PORT (every address NAME resolves to, round_robin); None lets the launcher start one.
    generator: str | None = None
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE  # text2image: {name} is the class name
    class_names_file: str | None = None  # text2image: one class name per line (needed for npz)
    ddim_steps: int = 10  # sampling steps (text2image: the pipeline's num_inference_steps)
    guidance: float = 1.0  # w of classifier-free guidance; docs/generator.md: w = 3 collapses the tiny digits model
    train_steps: int = 1500  # for a generator the launcher trains on first use
    size: str = "tiny"  # the UNet size the launcher trains on first use (docs/generator.md)
    exponent: float = 0.5  # b_k grows as (N_k / C)^exponent: 0.5 the paper's sqrt, 1.0 its linear ablation (Table 2)
    entropy_factor: bool = True  # false drops (1 - H_k / ln C) from b_k: the paper's entropy ablation (Table 2)
    # The quality filter: the generator serves only images its judge assigns to their class with at least this
    # probability, drawing more until the counts are met (docs/generator.md); 0 = off.
    min_confidence: float = 0.0
    # After a run, the launcher scores the generator it started with `fedsynth generator evaluate` on this many
    # images per class (cached per generator; report.json's generation.quality); 0 skips it.
    evaluate_per_class: int = 50

    def check(self) -> None:
        self.one_of("policy", POLICIES)
        self.one_of("backend", GENERATOR_BACKENDS)
        self.one_of("size", GENERATOR_SIZES)
        self.above(0, "beta")
        self.at_least(0, "budget")
        self.non_empty("model_dir")
        if self.generator is not None:
            generator_addresses(self.generator, key=self.key("generator"))
        check_prompt_template(self.prompt_template, key=self.key("prompt_template"))
        self.non_empty("class_names_file")
        self.within("ddim_steps", 1, 1000)  # the generator's sampling limits (generator_service.ddpm.sampling)
        self.within("guidance", 0, 100)
        self.at_least(1, "train_steps")
        self.at_least(0, "evaluate_per_class")
        if self.evaluate_per_class == 1:
            raise ConfigError(f"{self.key('evaluate_per_class')} must be 0 (off) or >= 2 (a covariance needs two images), got 1")
        self.within("exponent", 0, MAX_EXPONENT)
        self.within("min_confidence", 0, 1, high_open=True)


def generator_addresses(value: str, *, key: str = "generation.generator") -> tuple[str, ...]:
    """The generator replicas: HOST:PORT[,HOST:PORT...] (each a port in 1..65535, no repeats), or one
    dns:///NAME:PORT target whose resolved addresses a round_robin channel spreads requests over."""
    parts = tuple(part.strip() for part in value.split(","))
    for part in parts:
        host, _, port = part.removeprefix("dns:///").rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= MAX_PORT or any(c.isspace() for c in part):
            raise ConfigError(f"{key} must be HOST:PORT, HOST:PORT,HOST:PORT,... or dns:///NAME:PORT, got {value!r}")
    if len(set(parts)) < len(parts):
        raise ConfigError(f"{key} names a generator twice: {value!r}")
    if len(parts) > 1 and any(part.startswith("dns:///") for part in parts):
        raise ConfigError(f"{key}: a dns:/// target stands alone (it already names every replica), got {value!r}")
    return parts


def check_prompt_template(template: str, *, key: str) -> None:
    """A prompt template names exactly one field, {name}."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError:
        names = set()
    if names != {"name"}:
        raise ConfigError(f"{key} must contain {{name}} and no other field, got {template!r}")


@dataclass(frozen=True)
class SdaflConfig(Section):
    """SDA-FL knobs. The paper does not publish tau, lambda2, a, the GAN sizes or epsilon: these are our defaults."""

    SECTION: ClassVar[str] = "sdafl"
    samples_per_client: int = 200  # M: unlabelled DP-GAN samples each client uploads once
    tau: float = 0.95  # keep a pseudo-label only where the max class probability exceeds tau
    lambda2: float = 1.0  # weight of the cross-entropy on the real batch
    mixup_alpha: float = 1.0  # lambda ~ Beta(a, a)
    gan_steps: int = 100  # generator iterations of each client's WGAN-GP
    gan_batch_size: int = 32  # expected (Poisson) real batch size of the critic
    gan_latent_dim: int = 32  # the DP-GAN generator's noise dimension
    gan_width: int = 32  # channel width of the DP-GAN's generator and critic
    gan_lr: float = 1e-4  # Adam (0.5, 0.9) as in WGAN-GP; 1e-3 trains far faster for tiny CPU-sized GANs
    secure_noise: bool = False  # True: unpredictable DP noise (Opacus secure_mode); runs stop being reproducible
    target_epsilon: float = 10.0  # 0: no target, use noise_multiplier as given
    noise_multiplier: float = 1.0  # DP-SGD noise on the critic when target_epsilon is 0
    delta: float = 0.0  # 0: min(1e-5, N_k^-1.1) for each client (1e-5 for any shard under ~35,000 images)
    max_grad_norm: float = 1.0  # per-sample gradient clipping norm of the critic
    accountant: str = "rdp"  # the Opacus privacy accountant
    server_steps: int = 20  # global-model steps on the labelled synthetic set after each aggregation
    server_lr: float = 0.01  # the server's SGD lr on the synthetic set
    server_batch_size: int = 64  # the server's batch size on the synthetic set
    track_agreement: bool = True  # measure pseudo-label agreement with a centrally trained reference classifier

    def check(self) -> None:
        self.at_least(1, "samples_per_client", "gan_steps", "gan_batch_size", "gan_latent_dim", "gan_width",
                      "server_batch_size")
        self.within("tau", 0, 1, high_open=True)
        self.at_least(0, "target_epsilon", "noise_multiplier", "server_steps")
        self.above(0, "gan_lr", "max_grad_norm", "server_lr")
        for name in ("lambda2", "mixup_alpha"):  # the sdafl algorithm's parameters: its bounds
            self.bounded(name, ALGORITHM_PARAMS["sdafl"][name])
        self.within("delta", 0, 1, high_open=True)
        self.one_of("accountant", ACCOUNTANTS)


@dataclass(frozen=True)
class RuntimeConfig(Section):
    """Processes, addresses, deadlines and the transport."""

    SECTION: ClassVar[str] = "runtime"
    host: str = "127.0.0.1"  # address the launcher's coordinator and generator bind and its clients dial
    coordinator_port: int = 0  # the coordinator's gRPC port (0: a free one)
    round_timeout_s: float = 600.0  # a round closes at this deadline with the answers of a quorum
    quorum: float = 0.5  # share of the sampled clients (of all K at registration) a round needs
    registration_timeout_s: float = 300.0  # how long a fresh run waits for all K clients to register
    rejoin_grace_s: float = 10.0  # how long a disconnected client has to come back before rounds close without it
    clients_per_process: int = 1  # logical clients per client-node process the launcher starts
    torch_threads: int = 1  # torch CPU threads in each process the launcher starts
    heartbeat_s: float = 2.0  # coordinator -> client stream heartbeats, and each client's Heartbeat RPC
    heartbeat_timeout_s: float = 6.0  # a connected client silent this long is dropped (its stream ended)
    overlap_evaluation: bool = True  # test round r's model while round r+1 trains (same results, less wall-clock)
    tls_dir: str | None = None  # `fedsynth deploy provision` folder: the launcher runs every role over mutual TLS
    wire_dtype: str = "float32"  # client updates' floats on the wire; float16 / bfloat16 send them as deltas, half the bytes
    # "tcp": tasks' and updates' payloads of at least data_plane_min_bytes move over the coordinator's data plane (one
    # TCP or TLS connection per transfer, raw bytes, checksummed; docs/runtime.md), not as chunks on gRPC streams
    data_plane: str = "grpc"
    data_plane_min_bytes: int = 4 << 20  # smaller payloads stay on gRPC under data_plane = "tcp"
    # The most an update may move the global model: the L2 norm of its floating-point tensors as differences from the
    # round's global model (SCAFFOLD's delta c_i included). 0 = off; a number; or "auto": max_update_norm_factor times
    # the median norm of the round's updates (held until the round closes) and of those folded in the last 3 rounds.
    # Past it: update_norm_action.
    max_update_norm: float | str = 0.0
    max_update_norm_factor: float = 10.0
    update_norm_action: str = "refuse"  # "refuse": left out of the round; "clip": scaled down onto the bound
    # A client whose updates are refused this many rounds in a row is excluded from the run (report.json
    # excluded_clients); 0 = never excluded.
    max_refusals: int = 3
    # Secure aggregation (SecAgg+, docs/privacy.md): the coordinator sees only the masked sum of a round's
    # updates. Each client is paired with secagg_neighbours others (0: all the sampled clients; else even), and any
    # secagg_threshold of them (0: a majority, floor(neighbours / 2) + 1) rebuild a lost client's masks. Each element of
    # a client's move from the global model is clipped to +-secagg_clip before fixed-point quantisation in Z_2^32.
    secure_aggregation: bool = False
    secagg_neighbours: int = 0
    secagg_threshold: int = 0
    secagg_clip: float = 4.0
    secagg_stage_timeout_s: float = 60.0  # how long a key-exchange or unmasking stage waits for the sampled clients

    def check(self) -> None:
        self.at_least(0, "max_refusals", "secagg_neighbours", "secagg_threshold")
        if self.secagg_neighbours % 2:
            self._fail("secagg_neighbours", "0 (all) or an even number (each client's neighbours sit on both sides of a ring)")
        self.above(0, "secagg_clip", "secagg_stage_timeout_s")
        self.non_empty("host", "tls_dir")
        self.one_of("wire_dtype", WIRE_DTYPES)
        self.one_of("data_plane", DATA_PLANES)
        self.at_least(0, "data_plane_min_bytes")
        if self.max_update_norm != "auto" and (isinstance(self.max_update_norm, str) or self.max_update_norm < 0):
            self._fail("max_update_norm", '0 (off), a number > 0 or "auto"')
        self.within("max_update_norm_factor", 1, 1e6, low_open=True)
        self.one_of("update_norm_action", UPDATE_NORM_ACTIONS)
        self.within("coordinator_port", 0, 65535)
        self.above(0, "round_timeout_s", "registration_timeout_s", "heartbeat_s")
        self.within("quorum", 0, 1, low_open=True)
        self.at_least(0, "rejoin_grace_s")
        self.at_least(1, "clients_per_process", "torch_threads")
        if self.heartbeat_timeout_s < 2 * self.heartbeat_s:
            raise ConfigError(f"runtime.heartbeat_timeout_s={self.heartbeat_timeout_s!r} must be at least twice "
                              f"runtime.heartbeat_s={self.heartbeat_s!r} (one late heartbeat must not drop a client)")


@dataclass(frozen=True)
class FederateConfig(Section):
    """The federated class-conditional DDPM (train.algorithm = "ddpm", `fedsynth generator federate`):
    local training, the server-side EMA and differential privacy (docs/federated-generator.md)."""

    SECTION: ClassVar[str] = "federate"
    local_steps: int = 50  # optimizer steps per client per round
    batch_size: int = 64  # images per step (dp = "sample": the expected size of a Poisson-sampled logical batch)
    lr: float | None = None  # AdamW; None: the size's, as `generator train` (GENERATOR_TRAIN_LR)
    label_dropout: float = 0.1  # the null label's rate, for classifier-free guidance
    # The server's EMA of the global model, per round, warmed up as diffusers' EMAModel: min(decay, (1 + r) / (10 + r))
    ema_decay: float = 0.99
    dp: str = "none"  # none | user (DP-FedAvg: clip each client's update, noise on the sum) | sample (DP-SGD on each client)
    clip: float = 1.0  # S: the L2 bound of a client's update (user) or of one image's gradient (sample)
    noise_multiplier: float = 1.0  # sigma, used when target_epsilon is not set
    target_epsilon: float | None = None  # picks sigma (Opacus get_noise_multiplier) for the whole run
    delta: float = 1e-5  # the DP delta epsilon is accounted at (dp user or sample)
    accountant: str = "rdp"  # Opacus's: rdp or prv
    noise_multiplicity: int = 1  # dp = "sample": diffusion noise draws per image inside one per-sample gradient (DPDM)
    max_physical_batch: int = 64  # dp = "sample": Opacus BatchMemoryManager's physical batch (images)
    init: str | None = None  # a generator folder to start from (public data only: docs/federated-generator.md)
    secure_noise: bool = False  # unpredictable DP noise (a CSPRNG seed); runs stop being reproducible
    device: str = "cpu"  # where clients train the UNet: cpu, cuda, or auto (cuda when the client node has one)

    def check(self) -> None:
        self.one_of("device", ("cpu", "cuda", "auto"))
        self.at_least(1, "local_steps", "batch_size", "noise_multiplicity", "max_physical_batch")
        self.above(0, "lr", "clip", "target_epsilon")
        self.within("label_dropout", 0, 1, high_open=True)
        self.within("ema_decay", 0, 1, high_open=True)
        self.one_of("dp", DP_LEVELS)
        self.one_of("accountant", ACCOUNTANTS)
        self.within("delta", 0, 1, low_open=True, high_open=True)
        self.non_empty("init")
        if self.dp != "none" and self.target_epsilon is None:
            self.above(0, "noise_multiplier")
        else:
            self.at_least(0, "noise_multiplier")


@dataclass(frozen=True)
class EvolveConfig(Section):
    """Private Evolution over a public generator (train.algorithm = "pe", `fedsynth generator evolve`): the candidate
    set, the clients' nearest-neighbour votes and their differential privacy (docs/private-evolution.md)."""

    SECTION: ClassVar[str] = "evolve"
    candidates_per_class: int = 50  # M: the candidates each class's private images vote among, every iteration
    dp: str = "sample"  # sample (one private image changes one vote) | user (a client's votes, L2-normalised) | none
    noise_multiplier: float = 1.0  # sigma of the Gaussian noise on the summed histogram (sensitivity 1), without a target
    target_epsilon: float | None = None  # picks sigma (Opacus get_noise_multiplier) for train.rounds iterations
    delta: float = 1e-5  # the delta epsilon is accounted at (dp sample or user)
    accountant: str = "rdp"  # Opacus's: rdp or prv
    threshold: float = 2.0  # H, in units of sigma: a candidate needs more than H x sigma noisy votes to be drawn from
    strength_start: float = 0.8  # the variation strength (SDEdit's share of the schedule) after iteration 1 ...
    strength_end: float = 0.4  # ... falling linearly to this after the last
    embedder: str = "pixels"  # the public feature extractor the votes are cast in: "pixels" (hand-built) or "classifier"
    embedder_model: str | None = None  # embedder "classifier": its folder (scripts/train_public_embedder.py), on every node
    embedder_sha256: str | None = None  # ... and the hash of its weights, which every node checks its copy against
    secure_noise: bool = False  # the histogram's noise from a CSPRNG seed; runs stop being reproducible

    def check(self) -> None:
        self.at_least(1, "candidates_per_class")
        self.one_of("dp", DP_LEVELS)
        self.one_of("accountant", ACCOUNTANTS)
        self.one_of("embedder", EMBEDDERS)
        self.non_empty("embedder_model")
        if (self.embedder == "classifier") != (self.embedder_model is not None and self.embedder_sha256 is not None):
            raise ConfigError(f"evolve.embedder = {self.embedder!r} with evolve.embedder_model = {self.embedder_model!r} and "
                              f"evolve.embedder_sha256 = {self.embedder_sha256!r}: a \"classifier\" embedder needs both "
                              "(its folder and its weights' hash), \"pixels\" neither")
        if self.embedder_sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", self.embedder_sha256):
            raise ConfigError(f"evolve.embedder_sha256 must be 64 lowercase hex digits, got {self.embedder_sha256!r}")
        self.above(0, "target_epsilon")
        self.within("delta", 0, 1, low_open=True, high_open=True)
        self.at_least(0, "threshold")
        self.within("strength_start", 0, 1, low_open=True)
        self.within("strength_end", 0, 1, low_open=True)
        if self.dp != "none" and self.target_epsilon is None:
            self.above(0, "noise_multiplier")
        else:
            self.at_least(0, "noise_multiplier")


@dataclass(frozen=True)
class RunConfig(Section):
    """A run: its name, seed and output folder, then one table per section."""

    name: str = "default"  # a label for the run, recorded with its config
    seed: int = 0  # fixes partitions, sampling, generation and training order
    out_dir: str = "runs/default"  # where report.json, the checkpoint, plots and logs go
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    sdafl: SdaflConfig = field(default_factory=SdaflConfig)
    federate: FederateConfig = field(default_factory=FederateConfig)
    evolve: EvolveConfig = field(default_factory=EvolveConfig)

    def check(self) -> None:
        self.non_empty("name", "out_dir")
        self.within("seed", 0, MAX_SEED)
        unet = self.train.model.startswith("unet-")
        if (self.train.algorithm == "ddpm") != unet:
            raise ConfigError(f"train.model={self.train.model!r} with train.algorithm={self.train.algorithm!r}: the unet-* "
                              "models are trained by the \"ddpm\" algorithm, and it trains nothing else")
        if (self.train.algorithm == "pe") != (self.train.model == PE_MODEL):
            raise ConfigError(f"train.model={self.train.model!r} with train.algorithm={self.train.algorithm!r}: Private "
                              f"Evolution (\"pe\") keeps a vote per candidate, train.model = \"{PE_MODEL}\", and nothing else does")
        if self.train.algorithm == "pe":
            self._check_evolution()
        if unet and self.generation.policy != "none":
            raise ConfigError(f"generation.policy must be \"none\" when training a generator (train.algorithm = \"ddpm\"), "
                              f"got {self.generation.policy!r}")
        if unet and self.train.evaluation != "server":
            raise ConfigError(f"train.evaluation must be \"server\" when training a generator (train.algorithm = \"ddpm\"): "
                              f"the clients have no classifier to test, got {self.train.evaluation!r}")
        server_only = unet or self.train.algorithm == "pe"  # a generator's run: no classifier for the clients to test
        if self.data.source == "local" and self.data.test_dir is None and not server_only and self.train.evaluation != "federated":
            raise ConfigError(f"train.evaluation must be \"federated\" when data.source = \"local\" without data.test_dir: "
                              f"the coordinator holds no test data, got {self.train.evaluation!r}")
        # The same names as fedsynth.algorithms.robust.PLAIN_MEAN_ALGORITHMS (tests/test_robust_aggregation.py checks).
        if self.train.aggregation != "mean" and self.train.algorithm not in ("fedavg", "fedprox", "moon"):
            raise ConfigError(f"train.aggregation = {self.train.aggregation!r} needs train.algorithm = fedavg, fedprox or moon, "
                              f"got {self.train.algorithm!r}: a robust rule replaces the weighted mean of the models only, "
                              "and this algorithm's server side is more than that (SCAFFOLD's control variates, FedGen's "
                              "generator, FedMix's mean images, SDA-FL's synthetic set and pseudo-labels, ddpm's generator)")
        if self.train.dp == "user":
            self._check_user_dp()
        if self.runtime.secure_aggregation:
            self._check_secure_aggregation()
        if self.train.algorithm == "scaffold" and self.train.optimizer != "sgd":  # docs/guides/gpus.md, "Local optimizer"
            raise ConfigError(f"train.optimizer = {self.train.optimizer!r} with train.algorithm = \"scaffold\": SCAFFOLD's "
                              "control variates divide a round's move by the lr and the steps of (heavy-ball) SGD, which "
                              "an Adam step is not a multiple of; use train.optimizer = \"sgd\"")

    def _check_evolution(self) -> None:
        """Private Evolution's votes are summed, noised and thresholded by the coordinator as they are: refused, naming
        the key, whatever would change them on the way (docs/private-evolution.md)."""
        t, r = self.train, self.runtime
        refused = {
            "generation.policy": (self.generation.policy, "none", "the clients vote; they train no classifier to augment"),
            "train.evaluation": (t.evaluation, "server", "the clients have no model to test"),
            "train.aggregation": (t.aggregation, "mean", "the votes are summed; a robust rule has another sensitivity"),
            "train.dp": (t.dp, "none", "the votes' privacy is evolve.dp"),
            "runtime.wire_dtype": (r.wire_dtype, "float32", "a vote count must arrive exact"),
            "runtime.secure_aggregation": (r.secure_aggregation, False, "not built yet for the votes: the coordinator adds the noise"),
            "runtime.max_update_norm": (r.max_update_norm, 0.0, "each vote vector is bounded by evolve.dp's own rule"),
        }
        for key, (value, wanted, why) in refused.items():
            if value != wanted:
                raise ConfigError(f"{key} = {value!r} with train.algorithm = 'pe': {why}; leave it at {wanted!r}")
        g = self.generation
        if g.model_dir is None and g.generator is None:
            raise ConfigError("train.algorithm = \"pe\" needs a public generator: generation.model_dir (a folder trained on "
                              "public data only) or generation.generator (a running one); none would be trained on the "
                              "clients' data")
        if g.backend == "holdout" or g.min_confidence > 0:
            raise ConfigError(f"train.algorithm = \"pe\" with generation.backend = {g.backend!r} and generation.min_confidence = "
                              f"{g.min_confidence!r}: the holdout backend serves the run's real images and the quality "
                              "filter's judge learns the clients' training split; use a public ddpm or text2image model, unfiltered")

    def _check_user_dp(self) -> None:
        """train.dp = "user" only where the noisy mean of the clipped models is everything the server learns from the
        clients' training (docs/privacy.md says why each other setting is refused)."""
        t, g = self.train, self.generation
        why = {
            "ddpm": "the federated generator has its own DP settings: federate.dp = \"user\"",
            "scaffold": "SCAFFOLD's control variates reach the server un-noised beside the model",
            "fedmix": "FedMix shares the clients' mean images, which no model noise covers",
            "naivemix": "NaiveMix shares the clients' mean images, which no model noise covers",
            "sdafl": "SDA-FL's synthetic uploads have their own (DP-GAN) guarantee and its pseudo-labels are not clipped",
            "fedgen": "FedGen's server trains its generator on the clients' label counts and heads, outside the clipped mean",
        }
        if t.algorithm in why:
            raise ConfigError(f"train.dp = \"user\" with train.algorithm = {t.algorithm!r}: {why[t.algorithm]}; "
                              "user-level DP covers fedavg, fedprox and moon (FedEAS and its baselines are fedavg)")
        if t.aggregation != "mean":
            raise ConfigError(f"train.dp = \"user\" with train.aggregation = {t.aggregation!r}: DP-FedAvg's noise is calibrated "
                              "to one client's clipped share of a sum; a robust rule (a median, Krum's pick) has another "
                              "sensitivity; use train.aggregation = \"mean\" (the clip already bounds each client)")
        if g.policy != "none" and g.backend == "ddpm" and g.model_dir is None and g.generator is None:
            raise ConfigError("train.dp = \"user\" with generation.policy = " + repr(g.policy) + " and a generator trained on "
                              "first use: it would learn the clients' own images, outside the guarantee; use "
                              "generation.backend = \"holdout\" (held-out images no client holds), a generation.model_dir "
                              "trained on public data, or one from `fedsynth generator federate --dp user`")

    def _check_secure_aggregation(self) -> None:
        """runtime.secure_aggregation only where the server needs nothing but the weighted sum of the models, and
        with a threshold the round's neighbours can meet (docs/privacy.md)."""
        t, r = self.train, self.runtime
        why = {
            "fedmix": "its clients share mean images in the clear beside the model",
            "naivemix": "its clients share mean images in the clear beside the model",
            "sdafl": "its server pseudo-labels with each client's model, which a masked sum hides",
            "fedgen": "its server trains a generator on each client's classifier head, which a masked sum hides",
            "ddpm": "not built yet for the federated generator",
        }
        if t.algorithm in why:
            raise ConfigError(f"runtime.secure_aggregation with train.algorithm = {t.algorithm!r}: {why[t.algorithm]}; "
                              "it covers fedavg, fedprox, scaffold and moon (FedEAS and its baselines are fedavg)")
        if t.aggregation != "mean":
            raise ConfigError(f"runtime.secure_aggregation with train.aggregation = {t.aggregation!r}: a robust rule needs "
                              "each client's update, and secure aggregation shows the server only their sum")
        if r.max_update_norm != 0:
            raise ConfigError(f"runtime.secure_aggregation with runtime.max_update_norm = {r.max_update_norm!r}: the server "
                              "cannot measure a masked update's norm; each client clips its own (runtime.secagg_clip, "
                              "train.dp_clip)")
        if r.wire_dtype != "float32":
            raise ConfigError(f"runtime.secure_aggregation with runtime.wire_dtype = {r.wire_dtype!r}: a masked update is "
                              "32-bit integers whatever the wire dtype; leave it at float32")
        m = max(1, round(t.fraction * self.data.clients))
        holders = m - 1 if r.secagg_neighbours == 0 else min(r.secagg_neighbours, m - 1)
        if holders < 1:
            raise ConfigError(f"runtime.secure_aggregation needs at least 2 clients a round, got {m} "
                              "(train.fraction x data.clients)")
        if r.secagg_threshold and not holders / 2 < r.secagg_threshold <= holders:
            raise ConfigError(f"runtime.secagg_threshold = {r.secagg_threshold} must exceed half of each client's "
                              f"{holders} neighbours and not exceed them (0: {holders // 2 + 1})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Hash of everything that changes results; a checkpoint resumes only on a match. Where output goes, the
        runtime settings and the number of rounds are left out, so a finished run can be extended."""
        content = self.to_dict()
        content.pop("out_dir")
        content["data"].pop("local_dir")  # where the launcher finds the client folders changes no result
        content["data"].pop("test_dir")  # where the coordinator's test data lies changes no training result
        for key, default in LATER_DATA_KEYS.items():  # keys that came later: at their defaults, old fingerprints hold
            if content["data"][key] == default:
                content["data"].pop(key)
        content["generation"].pop("evaluate_per_class")  # scoring the generator after the run changes no result
        content["data"].pop("max_samples_per_client")
        content["train"].pop("device")  # where training runs: results differ in rounding only
        for section, defaults in RELEASE_0_2_KEYS.items():  # at the defaults, old fingerprints hold
            for key, default in defaults.items():
                if section != "runtime" and key in content[section] and content[section][key] == default:
                    content[section].pop(key)
        runtime = content.pop("runtime")
        wire_dtype = runtime["wire_dtype"]
        if wire_dtype != "float32":  # rounding the updates changes results; at the default, old fingerprints hold
            content["wire_dtype"] = wire_dtype
        if runtime["secure_aggregation"]:  # quantised sums (and distributed DP noise); off, old fingerprints hold
            content["secure_aggregation"] = {key: runtime[key] for key in ("secagg_neighbours", "secagg_threshold", "secagg_clip")}
        if runtime["max_update_norm"] != 0:  # a bound may clip or refuse updates; off, old fingerprints hold
            content["update_norm"] = {key: runtime[key] for key in UPDATE_NORM_KEYS}
        if self.train.dp == "user" and self.train.noise_multiplier is None:
            content["train"]["dp_rounds"] = self.train.rounds  # sigma follows from (target, rounds): no extending
        content["train"].pop("rounds")
        if content["train"]["algorithm"] != "ddpm":  # the section came later and changes only a generator's training
            content.pop("federate")
        elif content["federate"]["dp"] != "none" and content["federate"]["target_epsilon"] is not None:
            content["federate"]["rounds"] = self.train.rounds  # sigma follows from (target, rounds): no extending
        if content["train"]["algorithm"] != "pe":  # the section came later and changes only Private Evolution
            content.pop("evolve")
        else:  # the strength schedule and sigma follow from train.rounds: an evolution cannot be extended
            content["evolve"]["rounds"] = self.train.rounds
            content["evolve"].pop("embedder_model")  # where a node keeps the embedder: its hash says what it is
        for key, default in LATER_GENERATION_KEYS.items():  # keys that came later: at their defaults, old fingerprints hold
            if content["generation"][key] == default:
                content["generation"].pop(key)
        for section, defaults in LATER_EVALUATION_KEYS.items():
            for key, default in defaults.items():
                if content[section][key] == default:
                    content[section].pop(key)
        for key, paper in PAPER_RULE.items():  # the ablation keys came later: at the paper's rule, old fingerprints hold
            if content["generation"][key] == paper:
                content["generation"].pop(key)
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


SECTIONS = {
    "data": DataConfig,
    "train": TrainConfig,
    "generation": GenerationConfig,
    "runtime": RuntimeConfig,
    "sdafl": SdaflConfig,
    "federate": FederateConfig,
    "evolve": EvolveConfig,
}


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    """A section (or, where == "", the top level) from its table; its __post_init__ checks every value."""
    known = [f.name for f in fields(cls)]
    for key, value in values.items():
        if key in known:
            continue
        if where:
            raise ConfigError(f"unknown key {where}.{key} (known in [{where}]: {', '.join(known)})")
        if isinstance(value, dict):  # e.g. --set foo.bar=1
            inner = next(iter(value), "")
            raise ConfigError(f"unknown section [{key}] ({key}.{inner}); known sections: {', '.join(SECTIONS)}")
        raise ConfigError(f"unknown key {key} (known at the top level: {', '.join(known)})")
    return cls(**values)


def from_dict(raw: dict[str, Any]) -> RunConfig:
    _require(isinstance(raw, dict), f"a run config must be a table, got {raw!r}")
    sections: dict[str, Any] = {}
    data, train = raw.get("data", {}), raw.get("train", {})
    if (isinstance(data, dict) and isinstance(train, dict) and data.get("source") == "local" and "evaluation" not in train
            and data.get("test_dir") is None and train.get("algorithm") not in ("ddpm", "pe")):
        raw = {**raw, "train": {**train, "evaluation": "federated"}}  # local mode without test data: the clients test
    for name, cls in SECTIONS.items():
        table = raw.get(name, {})
        _require(isinstance(table, dict), f"{name} must be a table (the [{name}] section), got {table!r}")
        sections[name] = _build(cls, table, name)
    top = {key: value for key, value in raw.items() if key not in SECTIONS}
    return _build(RunConfig, top | sections, "")  # type: ignore[no-any-return]


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word such as fedeas or a path


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` (or `key=value` at the top level); the value is read as TOML, else a string."""
    merged = json.loads(json.dumps(raw))
    for item in overrides:
        key, sep, value = item.partition("=")
        _require(bool(sep) and bool(key), f"--set expects key=value, got {item!r}")
        *path, leaf = key.strip().split(".")
        node = merged
        for part in path:
            node = node.setdefault(part, {})
            _require(isinstance(node, dict), f"--set {item!r}: {part!r} is not a section")
        node[leaf] = _parse_value(value.strip())
    return merged


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        _require(p.is_file(), f"config file {str(path)!r} does not exist")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML ({exc})") from exc
    return from_dict(apply_overrides(raw, overrides or []))


def to_json(cfg: RunConfig) -> str:
    """The config as the run spec sends it: keys of RELEASE_0_2_KEYS at their defaults are left out (from_json fills them
    in), so a node of the release before them reads the spec and is refused at registration by its version."""
    content = cfg.to_dict()
    for section, defaults in RELEASE_0_2_KEYS.items():
        for key, default in defaults.items():
            if content[section][key] == default:
                content[section].pop(key)
    return json.dumps(content, sort_keys=True)


def from_json(text: str) -> RunConfig:
    return from_dict(json.loads(text))
