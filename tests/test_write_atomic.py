"""fedsynth.process.runtime.write_atomic: text, bytes, a streamed file or a folder replace a path whole, or not at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fedsynth.process.runtime import write_atomic


def test_text_and_bytes_replace_the_file_and_leave_nothing_beside_it(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "port"
    write_atomic(path, "7000\n")
    assert path.read_text() == "7000\n"
    write_atomic(path, b"\x00\xffbytes")
    assert path.read_bytes() == b"\x00\xffbytes"
    write_atomic(path, "é")
    assert path.read_bytes() == "é".encode()
    assert [p.name for p in path.parent.iterdir()] == ["port"]


def test_a_writer_streams_a_file_to_the_path(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.safetensors"
    write_atomic(path, lambda tmp: save_file({"w": torch.arange(3.0)}, str(tmp), metadata={"round": "2"}))
    assert torch.equal(load_file(str(path))["w"], torch.arange(3.0))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.safetensors"]


def test_a_writer_may_build_a_folder(tmp_path: Path) -> None:
    def write(folder: Path) -> None:
        (folder / "unet").mkdir(parents=True)
        (folder / "unet" / "weights.bin").write_bytes(b"w")
        (folder / "state.json").write_text(json.dumps({"step": 4}))

    write_atomic(tmp_path / "step-4", write)
    assert (tmp_path / "step-4" / "unet" / "weights.bin").read_bytes() == b"w"
    assert json.loads((tmp_path / "step-4" / "state.json").read_text()) == {"step": 4}
    assert [p.name for p in tmp_path.iterdir()] == ["step-4"]


def test_a_failing_writer_leaves_the_old_content_and_no_partial_file(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.json"
    path.write_text("old")

    def fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, fail)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["coordinator.json"]
