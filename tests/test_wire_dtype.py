"""runtime.wire_dtype: updates in float16 / bfloat16 as deltas, refused in any other dtype or when not finite, half
the bytes of a float32 run at about its accuracy."""

from __future__ import annotations

import functools
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from coordinator import checkpoint
from coordinator.updates import local_state, receive_update, update_layout
from deploy.processes import fedsynth_command
from fedsynth.wire import codec, wire_dtype
from fedsynth.algorithms.base import Aggregator
from fedsynth.algorithms.scaffold import ScaffoldAggregator
from fedsynth.config import load_config
from fedsynth.errors import ConfigError, WireError
from fedsynth.learning.models import build_model
from fedsynth.wire.tensor_buffer import encode_to_buffer
from fedsynth.wire.transfer import chunk_views, describe_buffer
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc
from runtime_harness import Runtime, channel, overrides, wait_until, register_request
from test_coordinator_bad_input import OpenRound, encoded, receive_task, stream_of, submit

StateDict = dict[str, torch.Tensor]
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@functools.cache
def _resnet_state() -> StateDict:
    torch.manual_seed(0)
    return build_model("resnet18", num_classes=10, in_channels=3, image_size=32).state_dict()


def bn_model_state() -> StateDict:
    """A model with BatchNorm (an int64 num_batches_tracked among its buffers)."""
    return {k: v.clone() for k, v in _resnet_state().items()}


def moved(state: StateDict, seed: int) -> StateDict:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 1e-3 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v + 1 for k, v in state.items()}


# ---- config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["float64", "fp16", "FLOAT16", "int8", ""])
def test_a_bad_wire_dtype_is_refused_naming_the_key_and_the_value(bad: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(None, [f"runtime.wire_dtype={json.dumps(bad)}"])
    assert "runtime.wire_dtype" in str(refused.value) and repr(bad) in str(refused.value)
    assert "float32, float16, bfloat16" in str(refused.value)


def test_the_default_is_float32_and_leaves_the_fingerprint_alone() -> None:
    default = load_config(None, [])
    assert default.runtime.wire_dtype == "float32"
    assert load_config(None, ['runtime.wire_dtype="float32"']).fingerprint() == default.fingerprint()
    assert load_config(None, ['runtime.wire_dtype="float16"']).fingerprint() != default.fingerprint()


# ---- the client's cast and the coordinator's fold --------------------------------------------------


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_floats_travel_as_deltas_in_the_wire_dtype_and_integer_buffers_keep_theirs(name: str) -> None:
    global_state = bn_model_state()
    local = moved(global_state, 1)
    extra = {"c": torch.full((3,), 0.25), "steps": torch.tensor([4])}
    model, sent_extra = wire_dtype.outgoing(local, extra, global_state, name)
    dtype = wire_dtype.torch_dtype(name)
    for key, value in model.items():
        if global_state[key].is_floating_point():
            assert value.dtype == dtype, key
            torch.testing.assert_close(value.float(), local[key] - global_state[key], rtol=1e-2, atol=1e-6)
        else:
            assert value.dtype == global_state[key].dtype == torch.int64 and torch.equal(value, local[key]), key
    assert "net.bn1.num_batches_tracked" in model
    assert sent_extra["c"].dtype == dtype and sent_extra["steps"].dtype == torch.int64


def test_float32_sends_the_update_as_it_is() -> None:
    global_state = bn_model_state()
    local, extra = moved(global_state, 1), {"c": torch.ones(2)}
    model, sent_extra = wire_dtype.outgoing(local, extra, global_state, "float32")
    assert model is local and sent_extra is extra


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_deltas_fold_to_the_weighted_mean_with_integer_buffers_exact(name: str) -> None:
    global_state = bn_model_state()
    locals_ = [moved(global_state, seed) for seed in (1, 2, 3)]
    exact, rounded = Aggregator(global_state), Aggregator(global_state)
    for weight, local in zip((10.0, 20.0, 70.0), locals_):
        exact.add(local, {}, weight)
        rounded.add(wire_dtype.outgoing(local, {}, global_state, name)[0], {}, weight, deltas=True)
    want, _ = exact.finish()
    got, _ = rounded.finish()
    for key, value in want.items():
        assert got[key].dtype == value.dtype, key
        if value.is_floating_point():
            # the error is relative to the step (1e-3), not to the weight: float16 keeps ~3 digits of it
            torch.testing.assert_close(got[key], value, rtol=0, atol=2e-5 if name == "float16" else 2e-5 * 8)
        else:
            assert torch.equal(got[key], value), key


def test_scaffold_steps_from_the_global_model_with_delta_updates() -> None:
    global_state = {"w": torch.tensor([1.0, -2.0, 3.0])}
    server = {"w": torch.zeros(3)}
    local = {"w": torch.tensor([1.5, -1.0, 2.0])}
    exact = ScaffoldAggregator(global_state, server, num_clients=1, global_lr=0.5)
    exact.add(local, {"w": torch.full((3,), 0.5)}, 1.0)
    rounded = ScaffoldAggregator(global_state, server, num_clients=1, global_lr=0.5)
    model, extra = wire_dtype.outgoing(local, {"w": torch.full((3,), 0.5)}, global_state, "float16")
    rounded.add(model, extra, 1.0, deltas=True)
    for want, got in zip(exact.finish(), rounded.finish()):
        assert torch.equal(want["w"], got["w"])  # every value here is exact in float16


# ---- the coordinator's check of one received update -------------------------------------------------


def received(tensors: StateDict, template: StateDict, wire: str, extra: StateDict | None = None) -> Any:
    buffer = encode_to_buffer(tensors)
    layout = update_layout(wire_dtype.expected_layout(codec.layout_of(template), wire),
                           wire_dtype.expected_layout(codec.layout_of(extra or {}), wire))
    return receive_update(describe_buffer(buffer), ((seq, bytes(piece)) for seq, piece in chunk_views(buffer)),
                          max_bytes=1 << 30, layout=layout, client_id=4, wire=wire)


@pytest.mark.parametrize(("wire", "sent"), [("float16", torch.float32), ("float32", torch.float16), ("bfloat16", torch.float16)])
def test_an_update_in_another_dtype_is_refused_naming_the_tensor_and_both_dtypes(wire: str, sent: torch.dtype) -> None:
    global_state = bn_model_state()
    template = {k: torch.empty_like(v, device="meta") for k, v in global_state.items()}
    update = {k: v.to(sent) if v.is_floating_point() else v for k, v in global_state.items()}
    with pytest.raises(WireError, match=rf"has dtype {sent}, expected {wire_dtype.torch_dtype(wire)}"):
        received(codec.join_prefixed(model=update), template, wire)


def test_float_extras_must_be_in_the_wire_dtype_too() -> None:
    global_state = {"w": torch.zeros(3), "n": torch.tensor(2)}
    template = {k: torch.empty_like(v, device="meta") for k, v in global_state.items()}
    model, _ = wire_dtype.outgoing(global_state, {}, global_state, "float16")
    extra = {"w": torch.zeros(3)}  # the algorithm's extras layout (SCAFFOLD's delta c), before the wire dtype
    with pytest.raises(WireError, match=r"extra tensors: tensor 'w' has dtype torch.float32, expected torch.float16"):
        received(codec.join_prefixed(model=model, extra={"w": torch.zeros(3)}), template, "float16", extra)
    update = received(codec.join_prefixed(model=model, extra={"w": torch.zeros(3, dtype=torch.float16)}), template, "float16", extra)
    assert update.deltas and update.state["n"].dtype == torch.int64
    rebuilt = local_state(update, global_state)
    assert rebuilt["w"].dtype == torch.float32 and torch.equal(rebuilt["n"], torch.tensor(2))


# ---- over the wire: a float16 coordinator refuses float32 and overflowed updates -------------------

SETTINGS = {"data.clients": 1, "train.rounds": 1, "runtime.round_timeout_s": 120.0, "runtime.rejoin_grace_s": 30.0,
            "runtime.wire_dtype": "float16"}


@pytest.fixture(scope="module")
def float16_round(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenRound]:
    root = tmp_path_factory.mktemp("wire-dtype")
    with Runtime(root) as rt:
        coord = rt.coordinator(SETTINGS, root / "run")
        with channel(coord.address) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            spec = stub.GetRunSpec(pb.GetRunSpecRequest(), timeout=20, wait_for_ready=True)
            session = stub.Register(register_request(spec, client_id=0, num_samples=100), timeout=20).session
            stream = stub.Subscribe(pb.SubscribeRequest(client_id=0, session=session), timeout=300)
            task, payload = receive_task(stream)
            yield OpenRound(stub, stream, session, session, task, payload, root / "run", {0: session}, [], set())
            stream.cancel()


def deltas_of(rnd: OpenRound, step: float) -> StateDict:
    return {k: torch.full_like(v, step, dtype=torch.float16) if v.is_floating_point() else v for k, v in rnd.model.items()}


def test_an_update_overflowed_in_float16_is_refused_naming_the_tensor() -> None:
    global_state = {"w": torch.zeros(3), "b": torch.zeros(10)}
    template = {k: torch.empty_like(v, device="meta") for k, v in global_state.items()}
    overflowed = {"w": torch.full((3,), 0.5, dtype=torch.float16), "b": torch.full((10,), 70000.0).to(torch.float16)}  # past 65504: inf
    with pytest.raises(WireError, match=r"'b' contains NaN or Inf"):
        received(codec.join_prefixed(model=overflowed), template, "float16")


@pytest.mark.slow
def test_a_mismatched_update_is_refused_over_the_wire_ends_its_senders_round_and_the_model_is_untouched(float16_round: OpenRound) -> None:
    rnd = float16_round
    before = rnd.model
    assert all(v.dtype == torch.float32 for v in before.values() if v.is_floating_point())  # the broadcast stays float32

    with pytest.raises(grpc.RpcError) as refused:
        submit(rnd, stream_of(rnd, encoded(before)))  # a float32 update where float16 is configured
    assert refused.value.code() == INVALID
    assert "has dtype torch.float32, expected torch.float16" in refused.value.details(), refused.value.details()

    # The refusal was its answer to the round: a second try is not taken (and, the only client, the round ends below
    # its quorum with nothing folded: no checkpoint, the initial model kept).
    with pytest.raises(grpc.RpcError) as again:
        submit(rnd, stream_of(rnd, encoded(deltas_of(rnd, 0.5))))
    assert again.value.code() == grpc.StatusCode.FAILED_PRECONDITION, again.value.details()
    assert checkpoint.load(rnd.out_dir) is None


# ---- end to end: float16 against float32 on digits -------------------------------------------------

# A runtime setting, results unchanged: client processes starved for 180 s at load average 113 never registered.
E2E = {"seed": 3, "data.clients": 3, "train.rounds": 2, "train.local_epochs": 3, "runtime.registration_timeout_s": 300.0}


def fedsynth_run(out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    sets = [item for o in overrides(settings) for item in ("--set", o)]
    done = subprocess.run(fedsynth_command("run", *sets, "--out-dir", str(out), "--no-progress"),
                          capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(1100)
def test_a_float16_run_receives_half_the_bytes_at_about_the_same_accuracy(tmp_path: Path) -> None:
    full = fedsynth_run(tmp_path / "float32", E2E)
    half = fedsynth_run(tmp_path / "float16", {**E2E, "runtime.wire_dtype": "float16"})
    assert [r["round"] for r in half["rounds"]] == [1, 2]
    for f32, f16 in zip(full["rounds"], half["rounds"]):
        assert f16["participants"] == f32["participants"] == [0, 1, 2]
        assert 0.48 < f16["bytes_received"] / f32["bytes_received"] < 0.53, (f16["bytes_received"], f32["bytes_received"])
        assert f16["bytes_sent"] == f32["bytes_sent"]  # the broadcast stays float32
    assert half["rounds"][-1]["accuracy"] > half["initial_accuracy"] + 0.2
    assert abs(half["rounds"][-1]["accuracy"] - full["rounds"][-1]["accuracy"]) < 0.03
