"""The `text2image` backend over real gRPC with a TINY random diffusers pipeline built and saved here (no download):
exact counts, bytes independent of batching and of the batch size, prompts from class names, validation, errors."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from fedsynth.wire import grpcutil
from fedsynth.config import load_config
from fedsynth.config_schema import CIFAR10_CLASSES
from fedsynth.errors import ConfigError
from fedsynth.generation.generator_client import GeneratorInfo
from fedsynth.v1 import generator_pb2, generator_pb2_grpc
from generator_service.backends.text2image import (
    check_template,
    class_names,
    load_text2image,
    to_dataset_images,
)
from generator_service.ddpm.sampling import ImageKey
from generator_service.serve_cmd import GeneratorServer, ServeConfig

CLASSES = 10
VOCAB_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"


def save_tiny_pipeline(folder: Path) -> Path:
    """A random SD-style pipeline a few kB big, as diffusers' own fast tests build one: UNet2DConditionModel,
    AutoencoderKL, a 2-layer CLIP text encoder, and a character-level CLIP tokenizer from a vocab made here."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, "!": 2}
    for ch in VOCAB_CHARS:  # every word splits into characters: no merges, distinct prompts give distinct ids
        vocab[ch], vocab[ch + "</w>"] = len(vocab), len(vocab) + 1
    words = folder / "tokenizer-source"
    words.mkdir(parents=True)
    (words / "vocab.json").write_text(json.dumps(vocab))
    (words / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(words / "vocab.json"), str(words / "merges.txt"), model_max_length=32)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(4, 8), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=8, norm_num_groups=2, attention_head_dim=2,
    )
    vae = AutoencoderKL(block_out_channels=(4, 8), in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=2,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=8, intermediate_size=16, num_attention_heads=2,
        num_hidden_layers=2, vocab_size=len(vocab), max_position_embeddings=32, projection_dim=8,
    ))
    scheduler = EulerDiscreteScheduler(timestep_spacing="trailing", steps_offset=1)  # SD-turbo's scheduler
    pipeline = StableDiffusionPipeline(unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                       scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)
    model = folder / "pipeline"
    pipeline.save_pretrained(model)  # 16x16 images (sample size 8 x VAE factor 2)
    return model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    threads = torch.get_num_threads()
    yield save_tiny_pipeline(tmp_path_factory.mktemp("text2image"))
    torch.set_num_threads(threads)  # the servers below pin 1 thread


def _server(model_dir: Path, **overrides: object) -> GeneratorServer:
    settings: dict[str, object] = {"backend": "text2image", "model": model_dir, "dataset": "digits", "ddim_steps": 2,
                                   "max_batch": 8, "max_wait_ms": 20.0, "metrics_port": -1, "threads": 1,
                                   "max_request_images": 500, **overrides}
    return GeneratorServer(ServeConfig(**settings), registry=CollectorRegistry())  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[GeneratorServer, grpc.Channel]]:
    server = _server(model_dir)
    port = server.start()
    server.load()
    channel = grpcutil.make_channel(f"127.0.0.1:{port}")
    yield server, channel
    channel.close()
    server.stop(0)


def _generate(channel: grpc.Channel, counts: list[int], seed: int, offsets: list[int] | None = None,
              model_id: str = "") -> tuple[np.ndarray, np.ndarray]:
    stub = generator_pb2_grpc.GeneratorStub(channel)
    request = generator_pb2.GenerateRequest(counts=counts, seed=seed, offsets=offsets or [], model_id=model_id)
    labels, images = [], []
    for batch in stub.Generate(request, timeout=120):
        labels.append(np.asarray(batch.labels))
        images.append(np.frombuffer(batch.images, np.uint8).reshape(len(batch.labels), batch.height, batch.width,
                                                                    batch.channels))
    return np.concatenate(labels), np.concatenate(images)


def test_info_describes_the_pipeline(served: tuple[GeneratorServer, grpc.Channel]) -> None:
    info = GeneratorInfo.fetch(served[1], timeout_s=10)
    assert (info.backend, info.dataset, info.num_classes, info.image_shape) == ("text2image", "digits", 10, (1, 8, 8))
    assert info.model_id.startswith("text2image-digits-") and info.size == "StableDiffusionPipeline"
    assert (info.device, info.dtype, info.ddim_steps, info.guidance, info.max_batch) == ("cpu", "float32", 2, 0.0, 8)
    assert info.parameters > 1000


def test_exact_counts_per_class_in_class_order(served: tuple[GeneratorServer, grpc.Channel]) -> None:
    labels, images = _generate(served[1], [3, 0, 5, 0, 0, 0, 0, 0, 0, 2], seed=1)
    assert labels.tolist() == [0] * 3 + [2] * 5 + [9] * 2
    assert images.shape == (10, 8, 8, 1) and images.dtype == np.uint8  # 16x16 RGB resized to digits' 8x8 gray
    assert len({img.tobytes() for img in images}) == 10  # each image its own latents


def test_same_bytes_in_one_batch_in_several_and_concurrently(model_dir: Path,
                                                             served: tuple[GeneratorServer, grpc.Channel]) -> None:
    counts = [2, 3, 0, 1, 0, 0, 0, 0, 0, 4]  # 10 images: two batches of 8 here, ten of 1 below
    _, reference = _generate(served[1], counts, seed=4)
    _, head = _generate(served[1], [2, 1], seed=4)  # one padded batch, other neighbours
    assert head.tobytes() == reference[:3].tobytes()
    one = _server(model_dir, max_batch=1)
    port = one.start()
    one.load()
    try:
        channel = grpcutil.make_channel(f"127.0.0.1:{port}")
        results: list[bytes] = []
        threads = [threading.Thread(target=lambda: results.append(_generate(channel, counts, seed=4)[1].tobytes()))
                   for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        one.stop(0)
    assert results == [reference.tobytes()] * 2  # max_batch 1, two requests interleaved: the max_batch 8 bytes
    _, other_seed = _generate(served[1], counts, seed=5)
    assert other_seed.tobytes() != reference.tobytes()


def test_offsets_continue_a_stream_exactly(served: tuple[GeneratorServer, grpc.Channel]) -> None:
    channel = served[1]
    _, whole = _generate(channel, [7, 2], seed=5)
    _, head = _generate(channel, [3, 2], seed=5)
    _, tail = _generate(channel, [4], seed=5, offsets=[3])
    assert np.concatenate([head[:3], tail, head[3:]]).tobytes() == whole.tobytes()


@pytest.mark.parametrize(
    ("fields", "code", "words"),
    [
        ({"counts": [1] * 11}, grpc.StatusCode.INVALID_ARGUMENT, "class id 10 is out of range 0..9"),
        ({"counts": [1], "offsets": [0] * 12}, grpc.StatusCode.INVALID_ARGUMENT, "offsets has 12 entries"),
        ({"counts": [0, 0, 0]}, grpc.StatusCode.INVALID_ARGUMENT, "empty request"),
        ({"counts": []}, grpc.StatusCode.INVALID_ARGUMENT, "empty request"),
        ({"counts": [400, 101]}, grpc.StatusCode.INVALID_ARGUMENT, "501 images requested, above the per-request limit of 500"),
        ({"counts": [0, 2], "offsets": [0, 2**32 - 1]}, grpc.StatusCode.INVALID_ARGUMENT, "class 1: offset 4294967295 + count 2"),
        ({"counts": [1], "model_id": "ddpm-tiny-digits-0"}, grpc.StatusCode.FAILED_PRECONDITION, "'ddpm-tiny-digits-0'"),
    ],
)
def test_bad_requests_get_the_ddpm_backends_codes(served: tuple[GeneratorServer, grpc.Channel], fields: dict,
                                                  code: grpc.StatusCode, words: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        _generate(served[1], seed=0, **fields)
    assert caught.value.code() == code and words in caught.value.details()


def test_device_seconds_and_images_are_counted(served: tuple[GeneratorServer, grpc.Channel]) -> None:
    server, channel = served
    registry = server.metrics.registry
    before = registry.get_sample_value("fedsynth_generator_images_total", {"class_id": "7"}) or 0.0
    _generate(channel, [0] * 7 + [3], seed=2)
    assert registry.get_sample_value("fedsynth_generator_images_total", {"class_id": "7"}) == before + 3
    assert (registry.get_sample_value("fedsynth_generator_device_seconds_total") or 0.0) > 0


def test_prompts_come_from_the_class_names_and_template(model_dir: Path, tmp_path: Path) -> None:
    backend = load_text2image(model_dir, dataset="cifar10", batch_size=2, steps=1, template="a {name}, blurry")
    assert backend.prompts[1] == "a automobile, blurry" and len(backend.prompts) == len(CIFAR10_CLASSES)
    assert backend.description.image_shape == (3, 32, 32)
    images = backend.sample([ImageKey(0, 3, 0), ImageKey(0, 9, 1)])
    assert images.shape == (2, 32, 32, 3) and images.dtype == np.uint8
    assert class_names("cifar100")[0][1] == "aquarium fish"
    other = load_text2image(model_dir, dataset="cifar10", batch_size=2, steps=1).description.model_id
    assert other != backend.description.model_id  # the prompts decide the bytes: they are part of the model id
    names = tmp_path / "names.txt"
    names.write_text("\n".join(f"thing {c}" for c in range(3)) + "\n")
    y = np.array([0, 1, 2] * 4)
    np.savez(tmp_path / "train.npz", x=np.zeros((len(y), 6, 6, 3), np.uint8), y=y)
    npz = load_text2image(model_dir, dataset="npz", data_dir=tmp_path, names_file=names, batch_size=1, steps=1)
    assert npz.prompts == ("a photo of a thing 0", "a photo of a thing 1", "a photo of a thing 2")
    assert npz.sample([ImageKey(1, 2, 0)]).shape == (1, 6, 6, 3)
    with pytest.raises(ConfigError, match="needs --class-names-file"):
        class_names("npz", data_dir=tmp_path)
    names.write_text("one\ntwo\n")
    with pytest.raises(ConfigError, match="names 2 classes; the dataset has 3"):
        class_names("npz", data_dir=tmp_path, names_file=names)


def test_resize_is_antialiased_and_gray_is_luma() -> None:
    stripes = torch.zeros(1, 3, 16, 16)
    stripes[..., ::2] = 1.0  # one-pixel stripes: an antialiased 2x shrink averages them to mid-gray
    out = to_dataset_images(stripes, (1, 8, 8))
    assert out.shape == (1, 8, 8, 1) and np.abs(out[:, :, 1:-1].astype(int) - 128).max() <= 1  # away from the edges
    red = torch.zeros(1, 3, 4, 4)
    red[:, 0] = 1.0
    assert to_dataset_images(red, (1, 4, 4)).max() == round(0.299 * 255)


def test_a_missing_or_empty_folder_is_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        _server(tmp_path / "nowhere")
    assert str(caught.value).startswith(f"text2image model folder {str(tmp_path / 'nowhere')!r} does not exist")
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="model_index.json is missing"):
        _server(tmp_path)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"backend": "text2image", "model": Path("m")}, "--backend text2image needs --dataset"),
        ({"backend": "text2image", "model": Path("m"), "dataset": "digits", "seed": 1},
         "--seed is a flag of --backend holdout, not of --backend text2image"),
        ({"model": Path("m"), "prompt_template": "x {name}"},
         "--prompt-template is a flag of --backend text2image, not of --backend ddpm"),
    ],
)
def test_serve_config_names_the_bad_flag(fields: dict, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ServeConfig(**fields)
    assert str(caught.value) == words


def test_templates_need_exactly_the_name_field() -> None:
    check_template("a photo of a {name}")
    for bad in ("a photo", "a {name} and {other}", "a {name", "{0}"):
        with pytest.raises(ConfigError):
            check_template(bad)
    with pytest.raises(ConfigError, match="generation.prompt_template"):
        load_config(None, ["generation.prompt_template=a photo"])


def test_guidance_runs_classifier_free_guidance(model_dir: Path) -> None:
    keys = [ImageKey(0, 1, 0), ImageKey(0, 2, 0)]
    plain = load_text2image(model_dir, dataset="digits", batch_size=2, steps=1).sample(keys)
    guided = load_text2image(model_dir, dataset="digits", batch_size=2, steps=1, guidance=3.0)
    assert guided.description.guidance == 3.0 and guided.sample(keys).tobytes() != plain.tobytes()


def test_launcher_flags_and_the_missing_model_dir(tmp_path: Path) -> None:
    from deploy.generator_setup import check_backend, serve_arguments
    from deploy.processes import ProcessGroup

    with pytest.raises(ConfigError, match="generation.backend = 'text2image' needs generation.model_dir"):
        check_backend(load_config(None, ["generation.backend=text2image"]))
    check_backend(load_config(None, ["generation.backend=text2image", "generation.generator=gpu1:50052,gpu2:50052"]))
    cfg = load_config(None, ["generation.backend=text2image", "generation.model_dir=/models/sd-turbo",
                             "generation.ddim_steps=1", "generation.guidance=0", "generation.prompt_template=a {name}"])
    flags = serve_arguments(cfg, ProcessGroup(tmp_path / "logs"))
    assert flags == ["--backend", "text2image", "--model", "/models/sd-turbo", "--dataset", "digits",
                     "--ddim-steps", "1", "--guidance", "0.0", "--prompt-template", "a {name}"]
    assert cfg.fingerprint() != load_config(None, ["generation.backend=text2image", "generation.model_dir=/models/sd-turbo",
                                                   "generation.ddim_steps=1", "generation.guidance=0"]).fingerprint()
    assert load_config(None, []).fingerprint() == load_config(None, ["generation.prompt_template=a photo of a {name}"]).fingerprint()


def test_an_ancestral_scheduler_draws_its_step_noise_per_image(model_dir: Path, tmp_path: Path) -> None:
    """SDXL-turbo's EulerAncestral adds fresh noise each step: from each row's own generator, so still per image."""
    from diffusers import AutoPipelineForText2Image, EulerAncestralDiscreteScheduler

    pipeline = AutoPipelineForText2Image.from_pretrained(model_dir, local_files_only=True)
    pipeline.scheduler = EulerAncestralDiscreteScheduler.from_config(pipeline.scheduler.config)
    pipeline.save_pretrained(tmp_path / "ancestral")
    keys = [ImageKey(3, c, j) for c in range(3) for j in range(2)]
    six = load_text2image(tmp_path / "ancestral", dataset="cifar10", batch_size=6, steps=3, guidance=2.0)
    one = load_text2image(tmp_path / "ancestral", dataset="cifar10", batch_size=1, steps=3, guidance=2.0)
    together = six.sample(keys)
    assert np.concatenate([one.sample([key]) for key in keys]).tobytes() == together.tobytes()
    assert six.sample(keys[::-1])[::-1].tobytes() == together.tobytes()  # position in the batch does not matter
