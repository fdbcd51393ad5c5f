"""One rule for the images and labels of an .npz, whether a client node loads it (its own data) or `fedsynth generator
evaluate --images` scores it: the same message, naming the file and the bad array's dtype and shape."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedsynth.errors import ConfigError, DataError
from fedsynth.learning.image_arrays import checked_image_arrays
from fedsynth.learning.label_schema import LabelSchema
from fedsynth.learning.local_data import load_client_data
from generator_service.evaluation.sources import from_npz

RULE = "x must be uint8 N x H x W x C and y N integer labels, found x float32 (5, 4, 4, 3), y int64 (5,)"


def test_a_grayscale_stack_gains_its_channel_and_a_good_pair_passes() -> None:
    x, y = checked_image_arrays(np.zeros((5, 4, 4), np.uint8), np.arange(5), "f.npz")
    assert x.shape == (5, 4, 4, 1) and y.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("x, y, found", [
    (np.zeros((5, 4, 4, 3), np.float32), np.arange(5), "found x float32 (5, 4, 4, 3), y int64 (5,)"),
    (np.zeros((5, 4, 4, 3), np.uint8), np.arange(4), "found x uint8 (5, 4, 4, 3), y int64 (4,)"),
    (np.zeros((5, 4, 4, 3), np.uint8), np.zeros(5, np.float64), "found x uint8 (5, 4, 4, 3), y float64 (5,)"),
    (np.zeros((5, 4), np.uint8), np.arange(5), "found x uint8 (5, 4), y int64 (5,)"),
])
def test_a_bad_pair_is_named(x: np.ndarray, y: np.ndarray, found: str) -> None:
    with pytest.raises(DataError, match=r"^f\.npz: x must be uint8 .*" + found.replace("(", r"\(").replace(")", r"\)")):
        checked_image_arrays(x, y, "f.npz")


def test_a_client_and_the_evaluator_refuse_one_bad_file_in_the_same_words(tmp_path: Path) -> None:
    bad = tmp_path / "train.npz"
    np.savez(bad, x=np.zeros((5, 4, 4, 3), np.float32), y=np.arange(5), classes=np.array(["a", "b", "c", "d", "e"]))
    with pytest.raises(DataError) as client:
        load_client_data(bad, LabelSchema(("a", "b", "c", "d", "e"), 4, 3), client_id=2)
    with pytest.raises(ConfigError) as evaluator:
        from_npz(bad, per_class=None)
    assert str(client.value).endswith(f"train.npz: {RULE}") and "client 2" in str(client.value)
    assert str(evaluator.value) == f"--images {bad}: {RULE}"
