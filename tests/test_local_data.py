"""A client's own data: `fedsynth data split` writes split mode's shards; the loader reads them back bit for bit in
every format, labels by class name, caches what it decoded, and names the client and the file for bad data."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from client_node.main import data_paths
from coordinator.schema_check import Schema, SchemaRefused, check_schema
from fedsynth.assembly import client_shard
from fedsynth.config import load_config
from fedsynth.errors import ConfigError, DataError
from fedsynth.learning.data import load_dataset
from fedsynth.learning.label_schema import LabelSchema, read_schema_file, schema_of
from fedsynth.learning.local_data import load_client_data
from fedsynth.learning.partition import holdout_split
from fedsynth.learning.split_export import SplitRequest, write_split

SPLIT = ["seed=3", "data.clients=4", "data.holdout_fraction=0.1"]
RGB = LabelSchema(("cat", "dog", "fox"), 4, 3)


def _split_cli(out: Path, fmt: str = "imagefolder") -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fedsynth.cli", "data", "split", "--dataset", "digits", "--clients", "4", "--alpha", "0.1",
         "--seed", "3", "--holdout-fraction", "0.1", "--format", fmt, "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def digits_folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("split") / "clients"
    _split_cli(out)
    return out


def test_data_split_writes_split_modes_shards_and_the_schema(digits_folders: Path) -> None:
    cfg = load_config(None, SPLIT)
    schema = schema_of(cfg.data)
    assert schema is not None and read_schema_file(digits_folders / "schema.toml") == schema
    test = load_dataset("digits", "test")
    test_rows = []
    for k in range(4):
        loaded = load_client_data(digits_folders / f"client-{k}", schema, client_id=k)
        shard = client_shard(cfg, k)
        assert np.array_equal(loaded.train.x, shard.x) and np.array_equal(loaded.train.y, shard.y)
        assert loaded.format == "imagefolder" and loaded.unknown_classes == () and loaded.schema_digest == schema.digest()
        assert loaded.test is not None and set(np.unique(loaded.test.y)) <= set(np.unique(shard.y))  # its own label mix
        test_rows += sorted(int(p.stem) for p in (digits_folders / f"client-{k}" / "test").rglob("*.png"))
    assert sorted(test_rows) == list(range(len(test.y)))  # every test image goes to exactly one client
    _, held = holdout_split(load_dataset("digits").y, 0.1, 3)
    assert sorted(int(p.stem) for p in (digits_folders / "holdout" / "train").rglob("*.png")) == held.tolist()


@pytest.mark.parametrize("fmt", ["npz", "hf"])
def test_npz_and_datasets_folders_load_the_same_shards(tmp_path: Path, fmt: str) -> None:
    cfg = load_config(None, SPLIT)
    schema = schema_of(cfg.data)
    assert schema is not None
    write_split(SplitRequest(cfg.data, cfg.seed, fmt, tmp_path / "out"), schema)
    for k in range(4):
        loaded = load_client_data(tmp_path / "out" / f"client-{k}", schema, client_id=k)
        shard = client_shard(cfg, k)
        assert loaded.format == fmt and loaded.test is not None
        assert np.array_equal(loaded.train.x, shard.x) and np.array_equal(loaded.train.y, shard.y)


def _png(path: Path, value: int, *, mode: str = "RGB", size: tuple[int, int] = (4, 4)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, value if mode == "L" else (value, value, value)).save(path)


def test_labels_come_from_folder_names_and_the_order_from_file_names(tmp_path: Path) -> None:
    # torchvision's ImageFolder would number the present folders dog=0, fox=1; the schema says dog=1, fox=2.
    _png(tmp_path / "train" / "fox" / "a.png", 10)
    _png(tmp_path / "train" / "dog" / "b.png", 20)
    _png(tmp_path / "train" / "fox" / "c.png", 30, size=(8, 8))  # square: resized to data.image_size
    loaded = load_client_data(tmp_path, RGB, client_id=0)
    assert loaded.train.y.tolist() == [2, 1, 2]  # a.png, b.png, c.png: by file name, not by class folder
    assert loaded.train.x.shape == (3, 4, 4, 3) and loaded.train.x[:, 0, 0, 0].tolist() == [10, 20, 30]
    assert loaded.test is None
    flat = tmp_path / "flat"  # class folders directly inside the client folder count as train/
    _png(flat / "cat" / "x.png", 5)
    assert load_client_data(flat, RGB, client_id=0).train.y.tolist() == [0]


def test_the_decoded_cache_is_reused_and_rebuilt_when_the_folder_changes(tmp_path: Path) -> None:
    data, cache = tmp_path / "data", tmp_path / "cache"
    for i in range(3):
        _png(data / "train" / "cat" / f"{i}.png", 40 + i)
    first = load_client_data(data, RGB, client_id=1, cache_dir=cache)
    files = list(cache.glob("*.npz"))
    assert len(files) == 1 and np.array_equal(load_client_data(data, RGB, client_id=1, cache_dir=cache).train.x, first.train.x)
    _png(data / "train" / "cat" / "1.png", 99)  # changed content: new size/mtime
    os.utime(data / "train" / "cat" / "1.png", ns=(1, 1))
    assert load_client_data(data, RGB, client_id=1, cache_dir=cache).train.x[1, 0, 0, 0] == 99
    files[0].write_bytes(b"damaged")  # a damaged cache is rebuilt, never trusted
    assert load_client_data(data, RGB, client_id=1, cache_dir=cache).train.x[:, 0, 0, 0].tolist() == [40, 99, 42]


def _bad_npz(folder: Path) -> None:
    folder.mkdir(parents=True)
    np.savez(folder / "train.npz", x=np.zeros((2, 4, 4, 3), np.uint8), y=np.array([0, 3]), classes=np.array(["cat", "dog"]))


BAD_DATA = {
    "empty": (lambda d: (d / "train" / "cat").mkdir(parents=True), "holds no training images"),
    "not an image": (lambda d: (_png(d / "train" / "cat" / "a.png", 1), (d / "train" / "cat" / "notes.txt").write_text("x")),
                     "train/cat/notes.txt: not an image"),
    "corrupt png": (lambda d: (d / "train" / "cat").mkdir(parents=True) or (d / "train" / "cat" / "a.png").write_bytes(b"\x89PNG\r\n\x1a\nxx"),
                    "train/cat/a.png: not a readable PNG or JPEG image"),
    "grayscale among RGB": (lambda d: (_png(d / "train" / "cat" / "a.png", 1), _png(d / "train" / "dog" / "b.png", 1, mode="L")),
                            "train/dog/b.png: 1 channel(s) (grayscale); data.channels is 3"),
    "not square": (lambda d: _png(d / "train" / "cat" / "a.png", 1, size=(4, 6)), "train/cat/a.png: 4x6 is not square"),
    "alpha": (lambda d: Image.new("RGBA", (4, 4)).save(_mk(d / "train" / "cat") / "a.png"), "train/cat/a.png: image mode RGBA"),
    "below min_size": (lambda d: _png(d / "train" / "cat" / "a.png", 1), "holds 1 training images; data.min_size is 2"),
    "npz label outside": (_bad_npz, "train.npz: field y: label 3 at row 1 is outside the file's 2 class names"),
}


def _mk(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_is_one_line_naming_the_client_and_the_file(tmp_path: Path, case: str) -> None:
    make, message = BAD_DATA[case]
    make(tmp_path / "c")
    with pytest.raises(DataError) as caught:
        load_client_data(tmp_path / "c", RGB, client_id=5, min_size=2)
    text = str(caught.value)
    assert text.startswith("client 5: ") and message in text and "\n" not in text


def test_classes_outside_the_schema_and_wrong_channels_are_reported_for_the_coordinator(tmp_path: Path) -> None:
    _png(tmp_path / "train" / "cat" / "a.png", 1, mode="L")
    _png(tmp_path / "train" / "wolf" / "b.png", 1, mode="L")
    loaded = load_client_data(tmp_path, RGB, client_id=2)
    assert loaded.unknown_classes == ("wolf",) and loaded.train.x.shape == (1, 4, 4, 1)
    run = Schema(RGB.digest(), 3, 4)
    with pytest.raises(SchemaRefused, match=r"^client 2: data\.classes: expected only the run's class names, found 'wolf'"):
        check_schema(2, run, Schema(loaded.schema_digest, 1, 4), loaded.unknown_classes)
    with pytest.raises(SchemaRefused, match=r"^client 2: data\.channels: expected 3, found 1$"):
        check_schema(2, run, Schema(loaded.schema_digest, 1, 4), ())
    other = LabelSchema(("dog", "cat", "fox"), 4, 3).digest()
    with pytest.raises(SchemaRefused, match=rf"^client 2: schema digest: expected {run.digest} .* found {other}"):
        check_schema(2, run, Schema(other, 3, 4), ())
    check_schema(2, run, Schema(RGB.digest(), 3, 4), ())
    check_schema(2, run, Schema("", 1, 9), ())  # a client that predates the check is not checked


def test_client_data_flags(tmp_path: Path) -> None:
    for k in (3, 4):
        (tmp_path / f"client-{k}").mkdir()
    assert data_paths([str(tmp_path)], [3, 4]) == {3: tmp_path / "client-3", 4: tmp_path / "client-4"}
    assert data_paths([f"4={tmp_path}/client-4", f"3={tmp_path}/client-3"], [3, 4])[3] == tmp_path / "client-3"
    assert data_paths([str(tmp_path / "client-3")], [3]) == {3: tmp_path / "client-3"}
    for values, message in (([str(tmp_path)], "no folder client-5/"), ([f"7={tmp_path}"], "client 7 is not hosted here"),
                            ([f"3={tmp_path}/nothing", f"4={tmp_path}"], "does not exist")):
        with pytest.raises(ConfigError, match=message):
            data_paths(values, [3, 4, 5] if "client-5" in message else [3, 4])


def test_local_data_keys_check_and_keep_old_fingerprints() -> None:
    assert load_config(None).fingerprint() == load_config(None, ['data.local_dir="/x"']).fingerprint()
    assert load_config(None).fingerprint() != load_config(None, ['data.source="local"']).fingerprint()
    assert load_config(None, ['data.classes=["a", "b"]']).data.classes == ("a", "b")
    for bad, message in (('data.channels=2', "data.channels must be 1 (grayscale) or 3 (RGB), got 2"),
                         ('data.classes=["a", "a"]', "data.classes names a class twice"),
                         ('data.classes=["a/b", "c"]', "'a/b' is not a usable class name"),
                         ('data.source="mine"', "data.source must be one of split, local"),
                         ('data.dataset="npz"', "data.classes must be set when data.source = \"local\"")):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_config(None, [bad, 'data.source="local"'] if "npz" in bad else [bad])


def test_run_in_local_mode_without_a_folder_is_refused_before_any_process(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "fedsynth.cli", "run", "--out-dir", str(tmp_path), "--set", 'data.source="local"'],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].endswith(
        'data.local_dir must name the folder of client-<k>/ folders when data.source = "local"')
    assert not (tmp_path / "logs").exists()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "schema.toml").write_text(LabelSchema(("a", "b"), 8, 1).to_toml())
    done = subprocess.run([sys.executable, "-m", "fedsynth.cli", "run", "--out-dir", str(tmp_path / "o"), "--set", 'data.source="local"',
                           "--set", "data.clients=1", "--set", f'data.local_dir="{tmp_path / "d"}"'],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "no client-0" in done.stderr


def test_generators_in_local_mode_read_the_schema_and_the_holdout_folder(digits_folders: Path, tmp_path: Path) -> None:
    from deploy.generator_setup import backend_arguments
    from deploy.processes import ProcessGroup
    from generator_service.backends.holdout import load_holdout, load_holdout_folder
    from generator_service.serve_cmd import ServeConfig

    group = ProcessGroup(tmp_path / "out" / "logs")
    cfg = load_config(None, ['generation.backend="text2image"', 'generation.model_dir="/models/sd-turbo"',
                             'data.classes=["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine_x"]'])
    flags = backend_arguments(cfg, group)
    names_file = Path(flags[flags.index("--class-names-file") + 1])
    assert names_file.read_text().splitlines() == ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine x"]
    local = load_config(None, [*SPLIT, 'data.source="local"', f'data.local_dir="{digits_folders}"', 'generation.backend="holdout"'])
    assert backend_arguments(local, group) == ["--backend", "holdout", "--holdout-dir", str(digits_folders / "holdout")]
    with pytest.raises(ConfigError, match="--holdout-dir serves that folder as it is"):
        ServeConfig(backend="holdout", holdout_dir=digits_folders / "holdout", seed=3)
    served, reference = load_holdout_folder(digits_folders / "holdout"), load_holdout("digits", fraction=0.1, seed=3)
    for c in range(10):  # the same images, class by class, in the same order as split mode's hold-out
        assert np.array_equal(served._images[served.held_out(c)], reference._images[reference.held_out(c)])
