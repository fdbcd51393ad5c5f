"""Hostile or odd client folders: every problem is one DataError line naming the file or folder, never a traceback or
a huge allocation; symbolic links stay inside the folder; the decoded cache never serves a changed folder's pixels."""

from __future__ import annotations

import os
import struct
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from fedsynth.errors import DataError
from fedsynth.learning import local_data
from fedsynth.learning.label_schema import LabelSchema
from fedsynth.learning.local_data import load_client_data

RGB = LabelSchema(("cat", "dog", "fox"), 4, 3)
SIGNATURE = b"\x89PNG\r\n\x1a\n"
Cached = tuple[Path, Callable[..., tuple[list[int], list[int]]], list[int]]  # the `cached` fixture


def _png(path: Path, value: int, *, mode: str = "RGB", size: tuple[int, int] = (4, 4)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, value if mode == "L" else (value, value, value)).save(path)
    return path


def _chunk(kind: bytes, data: bytes, *, crc: int | None = None) -> bytes:
    checksum = zlib.crc32(kind + data) if crc is None else crc
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", checksum)


def _bilevel_png(path: Path, width: int, height: int, *, pixels: bool = True) -> Path:
    """A 1-bit PNG declaring width x height: a few KB on disk (all-zero rows compress ~1000:1), or with `pixels` False
    only the header (its IDAT is empty: decoding it would fail as truncated, so a refusal naming the size proves the
    check came first)."""
    idat = b""
    if pixels:
        row, packer = b"\x00" * (1 + (width + 7) // 8), zlib.compressobj(9)
        idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b""))
    return path


def _refused(folder: Path, **options: object) -> str:
    with pytest.raises(DataError) as caught:
        load_client_data(folder, RGB, client_id=5, **options)  # type: ignore[arg-type]
    text = str(caught.value)
    assert text.startswith("client 5: ") and "\n" not in text, text
    return text


# ---- the pixel cap -------------------------------------------------------------------------------

def test_an_image_declaring_too_many_pixels_is_refused_from_its_header(tmp_path: Path) -> None:
    _png(tmp_path / "c" / "train" / "cat" / "a.png", 1)
    big = _bilevel_png(tmp_path / "c" / "train" / "cat" / "big.png", 6000, 6000)  # 36M pixels in ~5 KB
    assert big.stat().st_size < 10_000
    text = _refused(tmp_path / "c")
    assert ("train/cat/big.png: declares 6000x6000 = 36,000,000 pixels, more than data.max_image_pixels = 16,777,216"
            in text)
    _bilevel_png(big, 13000, 13000, pixels=False)  # the measured case: ~484 MiB per thread if decoded
    with pytest.warns(Image.DecompressionBombWarning):  # Pillow warns past 89M pixels, then the cap refuses
        assert "train/cat/big.png: declares 13000x13000" in _refused(tmp_path / "c")


def test_pillows_own_bomb_checks_become_one_line(tmp_path: Path) -> None:
    big = _bilevel_png(tmp_path / "c" / "train" / "cat" / "big.png", 20000, 20000, pixels=False)
    assert "train/cat/big.png: more pixels than Pillow decodes" in _refused(tmp_path / "c")  # DecompressionBombError
    _bilevel_png(big, 13000, 13000, pixels=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # DecompressionBombWarning raised from Image.open
        text = _refused(tmp_path / "c")
    assert "train/cat/big.png: more pixels than Pillow decodes" in text
    assert "data.max_image_pixels is 16,777,216" in text


def test_the_cap_is_data_max_image_pixels(tmp_path: Path) -> None:
    _png(tmp_path / "c" / "cat" / "a.png", 1)  # 4 x 4 = 16 pixels
    assert len(load_client_data(tmp_path / "c", RGB, client_id=5, max_image_pixels=16).train.y) == 1
    text = _refused(tmp_path / "c", max_image_pixels=15)
    assert "cat/a.png: declares 4x4 = 16 pixels, more than data.max_image_pixels = 15" in text


# ---- decoder failures ----------------------------------------------------------------------------

def _gif(path: Path) -> None:
    buffer = path.parent / "x.gif"
    Image.new("L", (4, 4)).save(buffer)
    buffer.rename(path)


GRAY_4X4 = struct.pack(">IIBBBBB", 4, 4, 8, 0, 0, 0, 0)  # IHDR: 4 x 4, 8-bit grayscale
CORRUPT: dict[str, Callable[[Path], object]] = {
    "bad header checksum": lambda p: p.write_bytes(SIGNATURE + _chunk(b"IHDR", GRAY_4X4, crc=1)),
    "short header": lambda p: p.write_bytes(SIGNATURE + _chunk(b"IHDR", b"\x00\x00")),
    "truncated pixels": lambda p: _bilevel_png(p, 4, 4, pixels=False),
    "truncated jpeg": lambda p: p.write_bytes(b"\xff\xd8\xff\xc0\x00\x05\x08\x00"),
    "a gif named .png": _gif,  # only PNG and JPEG are opened (Pillow would try every format, EPS included)
    "text": lambda p: p.write_text("hello"),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_a_file_the_decoder_cannot_read_is_one_line_naming_it(tmp_path: Path, case: str) -> None:
    _png(tmp_path / "c" / "train" / "cat" / "a.png", 1)
    bad = tmp_path / "c" / "train" / "dog" / "b.png"
    bad.parent.mkdir(parents=True)
    CORRUPT[case](bad)
    assert "train/dog/b.png: not a readable PNG or JPEG image (" in _refused(tmp_path / "c")


@pytest.mark.parametrize("error", [MemoryError(), struct.error("unpack requires a buffer of 4 bytes"),
                                   zlib.error("Error -3 while decompressing"), IndexError("list index out of range"),
                                   SyntaxError("broken PNG file\nsecond line")])
def test_any_decoder_exception_is_one_line_naming_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           error: Exception) -> None:
    _png(tmp_path / "c" / "train" / "cat" / "a.png", 1)

    def fail(self: Image.Image) -> None:
        raise error

    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", fail)
    text = _refused(tmp_path / "c")
    assert f"train/cat/a.png: not a readable PNG or JPEG image ({type(error).__name__}" in text


# ---- empty folders -------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["nothing", "empty train", "empty class folders", "flat, empty class folder"])
def test_a_folder_without_images_is_one_line_naming_it(tmp_path: Path, layout: str) -> None:
    client = tmp_path / "c"
    client.mkdir()
    made = {"empty train": ["train"], "empty class folders": ["train/cat", "train/dog", "test/cat"],
            "flat, empty class folder": ["cat"]}.get(layout, [])
    for folder in made:
        (client / folder).mkdir(parents=True)
    text = _refused(client, cache_dir=tmp_path / "cache")
    assert f"client folder {client.resolve()} holds no training images: no PNG or JPEG file under train/" in text


def test_empty_and_missing_classes_are_label_skew(tmp_path: Path) -> None:
    _png(tmp_path / "train" / "fox" / "a.png", 1)
    (tmp_path / "train" / "dog").mkdir()
    (tmp_path / "test" / "cat").mkdir(parents=True)
    loaded = load_client_data(tmp_path, RGB, client_id=5, cache_dir=tmp_path / "cache")
    assert loaded.train.y.tolist() == [2] and loaded.test is not None and len(loaded.test.y) == 0


# ---- symbolic links ------------------------------------------------------------------------------

@pytest.fixture()
def linked(tmp_path: Path) -> tuple[Path, Path]:
    """A client folder and a folder outside it, each with one image."""
    client, outside = tmp_path / "client", tmp_path / "elsewhere"
    _png(client / "train" / "cat" / "a.png", 10)
    _png(outside / "fox" / "z.png", 30)
    return client, outside


def test_links_inside_the_client_folder_are_followed(linked: tuple[Path, Path]) -> None:
    client, _ = linked
    _png(client / "extra" / "b.png", 20)
    (client / "train" / "dog").symlink_to(client / "extra", target_is_directory=True)
    (client / "train" / "cat" / "c.png").symlink_to("a.png")
    loaded = load_client_data(client, RGB, client_id=5)
    assert loaded.train.y.tolist() == [0, 1, 0] and loaded.train.x[:, 0, 0, 0].tolist() == [10, 20, 10]


@pytest.mark.parametrize("where", ["file", "class folder", "train folder", "test folder"])
def test_links_out_of_the_client_folder_are_refused_by_name_unless_followed(linked: tuple[Path, Path],
                                                                          where: str) -> None:
    client, outside = linked
    if where == "file":
        link, target = client / "train" / "cat" / "z.png", outside / "fox" / "z.png"
    elif where == "class folder":
        link, target = client / "train" / "fox", outside / "fox"
    else:
        name = where.split()[0]
        if name == "train":
            (client / "train" / "cat" / "a.png").rename(client / "a.png")
            (client / "train" / "cat").rmdir()
            (client / "train").rmdir()
        link, target = client / name, outside
    link.symlink_to(target)
    text = _refused(client)
    rel = str(link.relative_to(client))
    assert f"{rel}: a symbolic link to {target.resolve()}, outside the client folder {client.resolve()}" in text
    assert "data.follow_symlinks = true" in text
    loaded = load_client_data(client, RGB, client_id=5, follow_symlinks=True)
    followed = loaded.test if where == "test folder" else loaded.train
    assert followed is not None and 30 in followed.x[:, 0, 0, 0].tolist()  # z.png, from outside


def test_a_link_out_of_a_linked_folder_inside_is_still_refused(linked: tuple[Path, Path]) -> None:
    client, outside = linked
    (client / "extra").mkdir()
    (client / "extra" / "z.png").symlink_to(outside / "fox" / "z.png")  # inside, but pointing out again
    (client / "train" / "dog").symlink_to(client / "extra")
    assert f"train/dog/z.png: a symbolic link to {(outside / 'fox' / 'z.png').resolve()}" in _refused(client)


def test_broken_and_looping_links_are_one_line(linked: tuple[Path, Path]) -> None:
    client, _ = linked
    (client / "train" / "cat" / "gone.png").symlink_to("missing.png")
    assert "train/cat/gone.png: a broken symbolic link (to 'missing.png')" in _refused(client, follow_symlinks=True)
    (client / "train" / "cat" / "gone.png").unlink()
    (client / "train" / "cat" / "loop.png").symlink_to("loop.png")
    assert "train/cat/loop.png: " in _refused(client, follow_symlinks=True)


def test_an_npz_linked_from_outside_is_refused(tmp_path: Path) -> None:
    client, outside = tmp_path / "client", tmp_path / "elsewhere"
    client.mkdir()
    outside.mkdir()
    np.savez(outside / "train.npz", x=np.zeros((1, 4, 4, 3), np.uint8), y=np.array([0]), classes=np.array(["cat"]))
    (client / "train.npz").symlink_to(outside / "train.npz")
    assert "train.npz: a symbolic link to" in _refused(client)
    assert load_client_data(client, RGB, client_id=5, follow_symlinks=True).train.y.tolist() == [0]


# ---- the decoded cache against the folder --------------------------------------------------------

@pytest.fixture()
def cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cached:
    """A client folder, a loader through the cache giving (labels, first pixel of each image), and how many images
    each load decoded (0: served from the cache)."""
    client, cache = tmp_path / "client", tmp_path / "cache"
    for i, cls in enumerate(("cat", "dog", "cat")):
        _png(client / "train" / cls / f"{i}.png", 40 + i)
    decoded: list[int] = []
    real = local_data.decode_images

    def counting(paths: list[Path], *args: object, **kwargs: object) -> np.ndarray:
        decoded.append(len(paths))
        return real(paths, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(local_data, "decode_images", counting)

    def load(**options: object) -> tuple[list[int], list[int]]:
        data = load_client_data(client, RGB, client_id=5, cache_dir=cache, **options).train  # type: ignore[arg-type]
        return data.y.tolist(), data.x[:, 0, 0, 0].tolist()

    assert load() == ([0, 1, 0], [40, 41, 42]) and load() == ([0, 1, 0], [40, 41, 42]) and decoded == [3]
    return client, load, decoded


def _same_stat(path: Path, replacement: Path) -> None:
    """Replace `path` by `replacement` (same size required) and set the old mtime back, as cp -p or rsync -t would."""
    old = path.stat()
    assert replacement.stat().st_size == old.st_size
    os.replace(replacement, path)
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))


def test_the_cache_serves_an_unchanged_folder(cached: Cached) -> None:
    _, load, decoded = cached
    assert load() == ([0, 1, 0], [40, 41, 42]) and decoded == [3]


def test_a_file_added_or_removed_is_decoded_again(cached: Cached) -> None:
    client, load, decoded = cached
    _png(client / "train" / "fox" / "3.png", 43)
    assert load() == ([0, 1, 0, 2], [40, 41, 42, 43]) and decoded == [3, 4]
    (client / "train" / "cat" / "0.png").unlink()
    assert load() == ([1, 0, 2], [41, 42, 43]) and decoded == [3, 4, 3]


def test_a_file_replaced_with_the_same_size_and_mtime_is_decoded_again(
        cached: Cached, tmp_path: Path) -> None:
    client, load, decoded = cached
    _same_stat(client / "train" / "cat" / "2.png", _png(tmp_path / "new.png", 99))
    assert load() == ([0, 1, 0], [40, 41, 99]) and decoded == [3, 3]


def test_a_file_moved_to_another_class_is_relabelled(cached: Cached) -> None:
    client, load, decoded = cached
    (client / "train" / "fox").mkdir()
    moved = client / "train" / "fox" / "2.png"
    (client / "train" / "cat" / "2.png").rename(moved)
    assert load() == ([0, 1, 2], [40, 41, 42]) and decoded == [3, 3]
    # swapped between two classes, names, sizes and mtimes kept: still relabelled
    (client / "train" / "dog" / "1.png").rename(client / "train" / "fox" / "1.png")
    moved.rename(client / "train" / "dog" / "2.png")
    assert load() == ([0, 2, 1], [40, 41, 42]) and decoded == [3, 3, 3]


def test_a_lower_pixel_cap_is_not_bypassed_by_the_cache(cached: Cached) -> None:
    _, load, _ = cached
    with pytest.raises(DataError, match=r"train/cat/0\.png: declares 4x4 = 16 pixels, more than data\.max_image_pixels = 8 "):
        load(max_image_pixels=8)
