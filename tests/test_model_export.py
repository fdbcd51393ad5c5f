"""The trained model back (issue 47): `fedsynth export` of a real run folder, `fedsynth.load_model`, `fedsynth predict`
on the clients' held-out PNGs giving exactly the report's federated accuracy, a changed weights file refused by its
SHA-256, and `fedsynth report` on a coordinator's run folder (coordinator.json and the checkpoint alone)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

import fedsynth
from fedsynth.cli import main as fedsynth_main
from fedsynth.errors import DataError
from fedsynth.learning.data import load_dataset
from fedsynth.learning.training import images_to_tensor

CLIENTS = 2
RUN = ["data.clients=2", "train.rounds=1", "train.local_epochs=2", "runtime.clients_per_process=2", "seed=0",
       "generation.policy=\"none\"", "data.source=\"local\"", "train.evaluation=\"federated\""]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny real run in local mode over `fedsynth data split`'s digits folders (2 clients, 1 round): the clients'
    test/ folders hold digits' whole test split between them, so the federated accuracy is the test split's."""
    root = tmp_path_factory.mktemp("model-back")
    folders = root / "clients"
    assert fedsynth_main(["data", "split", "--dataset", "digits", "--clients", str(CLIENTS), "--alpha", "0.5",
                          "--seed", "0", "--out", str(folders)]) == 0
    out = root / "run"
    sets = [*RUN, f"data.local_dir={json.dumps(str(folders))}"]
    done = subprocess.run([sys.executable, "-m", "fedsynth.cli", "run", "--out-dir", str(out), "--no-progress",
                           *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    model = root / "export" / "model.safetensors"
    assert fedsynth_main(["export", str(out), "--out", str(model)]) == 0
    return {"folders": folders, "run": out, "model": model}


def _report(run: dict[str, Path]) -> dict:
    return json.loads((run["run"] / "report.json").read_text())


def test_export_writes_the_state_dict_and_its_sidecar(run: dict[str, Path]) -> None:
    model, report = run["model"], _report(run)
    sidecar = json.loads(model.with_suffix(".json").read_text())
    with safe_open(str(run["run"] / "checkpoint.safetensors"), framework="pt") as handle:
        checkpoint_keys = {key.removeprefix("model/") for key in handle.keys() if key.startswith("model/")}
    weights = load_file(str(model))
    assert set(weights) == checkpoint_keys and checkpoint_keys
    assert {k: v for k, v in sidecar.items() if k not in ("normalisation", "resize", "sha256")} == {
        "format": "fedsynth-model", "version": 1, "classes": [str(d) for d in range(10)], "image_size": 8, "channels": 1,
        "model": "cnn", "algorithm": "fedavg", "moon_projection_dim": 0, "run_id": report["run_id"], "rounds": 1,
        "final_accuracy": report["final_accuracy"], "accuracy_source": "federated",
    }
    assert sidecar["normalisation"]["formula"] == "x / 127.5 - 1" and sidecar["normalisation"]["mean"] == [0.5]
    assert sidecar["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()


def test_load_model_reproduces_the_runs_final_accuracy(run: dict[str, Path]) -> None:
    model = fedsynth.load_model(run["model"])
    assert isinstance(model, torch.nn.Module)
    assert not any(m.training for m in model.modules())
    test = load_dataset("digits", "test")
    with torch.inference_mode():
        predicted = model(images_to_tensor(test.x)).argmax(dim=1).numpy()
    assert int((predicted == test.y).sum()) / len(test.y) == _report(run)["final_accuracy"]


def test_predict_on_the_clients_held_out_images_gives_the_reports_federated_accuracy(
        run: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    tests = [run["folders"] / f"client-{k}" / "test" for k in range(CLIENTS)]
    assert fedsynth_main(["predict", "--model", str(run["model"]), *map(str, tests), "--json"]) == 0
    predictions = json.loads(capsys.readouterr().out)["predictions"]
    last = _report(run)["federated_evaluation"][-1]["per_client"]
    for k, folder in enumerate(tests):
        mine = [p for p in predictions if Path(p["path"]).is_relative_to(folder)]
        assert [p["path"] for p in mine] == sorted(str(p) for p in folder.rglob("*.png"))
        correct = sum(p["class"] == Path(p["path"]).parent.name for p in mine)
        assert (correct, len(mine)) == (last[str(k)]["correct"], last[str(k)]["examples"])
        assert correct / len(mine) == last[str(k)]["accuracy"]
    assert sum(p["class"] == Path(p["path"]).parent.name for p in predictions) / len(predictions) == \
        _report(run)["final_accuracy"]
    # the same classes as load_model gives on the same PNGs read with Pillow
    x = np.stack([np.asarray(Image.open(p["path"]), dtype=np.uint8)[..., None] for p in predictions])
    with torch.inference_mode():
        logits = fedsynth.load_model(run["model"])(images_to_tensor(x))
    assert [p["label"] for p in predictions] == logits.argmax(dim=1).tolist()
    assert [p["class"] for p in predictions] == [str(label) for label in logits.argmax(dim=1).tolist()]
    assert [p["probability"] for p in predictions] == pytest.approx(torch.softmax(logits, 1).max(1).values.tolist(), abs=1e-6)
    # without --json: path, class name and probability, tab-separated, one line per image
    assert fedsynth_main(["predict", "--model", str(run["model"]), str(tests[0])]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[:2] for line in lines] == [[p["path"], p["class"]] for p in predictions[:len(lines)]]
    assert len(lines) == last["0"]["examples"]


def _copy_model(run: dict[str, Path], folder: Path) -> Path:
    folder.mkdir()
    shutil.copy(run["model"], folder / "model.safetensors")
    shutil.copy(run["model"].with_suffix(".json"), folder / "model.json")
    return folder / "model.safetensors"


def test_a_changed_weights_file_is_refused_by_its_sha256(run: dict[str, Path], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    model = _copy_model(run, tmp_path / "tampered")
    data = bytearray(model.read_bytes())
    data[-1] ^= 0x01  # one bit of the last weight
    model.write_bytes(bytes(data))
    with pytest.raises(DataError, match="sha256"):
        fedsynth.load_model(model)
    assert fedsynth_main(["predict", "--model", str(model), str(run["folders"] / "client-0" / "test")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sha256" in err[0] and str(model) in err[0] and "Traceback" not in err[0]


def test_a_sidecar_that_does_not_fit_the_weights_is_refused_naming_the_key(run: dict[str, Path], tmp_path: Path) -> None:
    model = _copy_model(run, tmp_path / "other")
    sidecar = json.loads(model.with_suffix(".json").read_text())
    sidecar["channels"] = 3  # weights of a grayscale model under an RGB model's sidecar: the first conv's shape differs
    model.with_suffix(".json").write_text(json.dumps(sidecar))
    with pytest.raises(DataError, match=r"'body\.0\.weight' has shape") as refused:
        fedsynth.load_model(model)
    assert str(model) in str(refused.value)


def test_predict_refuses_bad_input_in_one_line(run: dict[str, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.png").write_text("not an image")
    Image.new("L", (10, 8)).save(tmp_path / "wide.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "colour.png")
    cases = {"missing.png": "no such file or folder", "notes.png": "not a readable PNG or JPEG image",
             "wide.png": "10x8 is not square; data.image_size = 8", "colour.png": "3 channel(s)"}
    for name, expected in cases.items():
        assert fedsynth_main(["predict", "--model", str(run["model"]), str(tmp_path / name), "--json"]) == 1, name
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and expected in err[0] and name in err[0], (name, err)
        assert captured.out == ""


def test_report_and_export_of_a_coordinators_run_folder(run: dict[str, Path], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "coord-run"
    folder.mkdir()
    for name in ("coordinator.json", "checkpoint.safetensors"):
        shutil.copy(run["run"] / name, folder / name)
    assert fedsynth_main(["report", str(folder)]) == 0
    assert str(folder / "report.json") in capsys.readouterr().out.split()
    report, original = json.loads((folder / "report.json").read_text()), _report(run)
    for key in ("run_id", "final_accuracy", "federated_evaluation", "accuracy_source", "success", "config"):
        assert report[key] == original[key], key
    assert [r["accuracy"] for r in report["rounds"]] == [r["accuracy"] for r in original["rounds"]]
    assert report["processes"] == {} and report["wall_clock_s"] > 0
    assert (folder / "report.md").read_text().startswith(f"# Run {report['run_id']}: succeeded")
    model = tmp_path / "from-coordinator.safetensors"
    assert fedsynth_main(["export", str(folder), "--out", str(model)]) == 0
    assert model.read_bytes() == run["model"].read_bytes()
    assert json.loads(model.with_suffix(".json").read_text()) == json.loads(run["model"].with_suffix(".json").read_text())


def test_import_fedsynth_stays_light() -> None:
    done = subprocess.run([sys.executable, "-c", "import sys, fedsynth; assert callable(fedsynth.load_model); "
                           "print(sorted(m for m in ('torch', 'numpy', 'safetensors') if m in sys.modules))"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
