"""What the coordinator checks of a member before it acknowledges anything: the whole update against the model's and
the algorithm's layouts (header size first), integer counters, reported numbers, the node's release; and the record
of refusals that turns repeated ones into an exclusion."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter

from coordinator.members.refusals import RefusalLedger, reason_of, run_record
from coordinator.updates import check_integer_moves, check_reports, decode_update, update_layout
from fedsynth import __version__
from fedsynth.algorithms import get_algorithm
from fedsynth.algorithms.base import extra_layout
from fedsynth.config import RunConfig, from_json, to_json
from fedsynth.errors import WireError
from fedsynth.learning.models import build_model
from fedsynth.wire import codec, versions, wire_dtype
from fedsynth.wire.tensor_buffer import encode_to_buffer

GLOBAL = {"conv.weight": torch.zeros(4, 3), "bn.running_mean": torch.zeros(4), "bn.num_batches_tracked": torch.tensor(7)}


def layout_for(extra: dict[str, Any] | None = None, wire: str = "float32") -> Any:
    model = wire_dtype.expected_layout(codec.layout_of(GLOBAL), wire)
    return update_layout(model, wire_dtype.expected_layout(codec.layout_of(extra or {}), wire))


def decoded(tensors: dict[str, torch.Tensor], extra_template: dict[str, torch.Tensor] | None = None) -> Any:
    return decode_update(encode_to_buffer(tensors), layout=layout_for(extra_template), client_id=3)


def update(**extra: torch.Tensor) -> dict[str, torch.Tensor]:
    return codec.join_prefixed(model=dict(GLOBAL), **({"extra": extra} if extra else {}))


# ---- the update against its layouts --------------------------------------------------------------------------


def test_an_extra_tensor_the_algorithm_does_not_send_is_refused_by_name() -> None:
    for junk in (torch.zeros(1), torch.zeros(1, dtype=torch.int64)):  # a node of another release; an integer one too
        with pytest.raises(WireError, match=r"client 3: extra tensors: missing tensors \[\] / unexpected tensors \['junk'\]"):
            decoded(update(junk=junk))


def test_scaffold_declares_its_delta_c_and_an_integer_one_is_refused_before_the_fold() -> None:
    model = build_model("cnn", num_classes=10, in_channels=1, image_size=8)
    scaffold = get_algorithm("scaffold", num_clients=4)
    declared = extra_layout(scaffold, model)
    assert declared == {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()}
    assert extra_layout(get_algorithm("fedavg"), model) == {}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    layout = update_layout(codec.layout_of(state), declared)
    giant = {name: torch.full(shape, 2**62, dtype=torch.int64) for name, (shape, _) in declared.items()}
    with pytest.raises(WireError, match=r"extra tensors: tensor '[a-z0-9_.]+' has dtype torch.int64, expected torch.float32"):
        decode_update(encode_to_buffer(codec.join_prefixed(model=state, extra=giant)), layout=layout, client_id=1)
    honest = {name: torch.zeros(shape) for name, (shape, _) in declared.items()}
    got = decode_update(encode_to_buffer(codec.join_prefixed(model=state, extra=honest)), layout=layout, client_id=1)
    assert got.extra.keys() == declared.keys()


def test_a_header_longer_than_the_layout_needs_is_refused_before_it_is_parsed() -> None:
    layout = layout_for()
    honest = bytes(encode_to_buffer(update()).numpy())
    assert int.from_bytes(honest[:8], "little") < layout.max_header_bytes  # what an encoder of it writes fits
    many = json.dumps({f"model/e{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(150_000)}).encode()
    nested = ("[" * 100_000 + "]" * 100_000).encode()
    for header in (many, nested):
        raw = len(header).to_bytes(8, "little") + header
        with pytest.raises(WireError, match=rf"header of {len(header)} bytes exceeds the limit of {layout.max_header_bytes}"):
            decode_update(torch.frombuffer(bytearray(raw), dtype=torch.uint8), layout=layout, client_id=3)


def test_json_nested_deeper_than_the_parser_follows_is_a_refusal_not_a_crash() -> None:
    header = ("[" * 50_000 + "]" * 50_000).encode()
    raw = len(header).to_bytes(8, "little") + header
    from fedsynth.wire.tensor_buffer import decode_views

    with pytest.raises(WireError, match="nests deeper"):
        decode_views(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


# ---- integer counters and reported numbers --------------------------------------------------------------------


def moved(by: int) -> Any:
    return decoded(codec.join_prefixed(model={**GLOBAL, "bn.num_batches_tracked": torch.tensor(7 + by)}))


def test_num_batches_tracked_may_move_forward_by_a_rounds_steps_and_no_more() -> None:
    check_integer_moves(moved(40), GLOBAL, max_steps=40, client_id=3)
    for by, shown in ((41, "41"), (2**62, str(2**62)), (-1, "-1")):
        with pytest.raises(WireError, match=rf"integer tensor 'bn.num_batches_tracked' moved by {shown} in one round; at most 40"):
            check_integer_moves(moved(by), GLOBAL, max_steps=40, client_id=3)


def test_an_integer_tensor_that_is_no_counter_may_not_move() -> None:
    base = {"w": torch.zeros(2), "ids": torch.tensor([1, 2])}
    got = decode_update(encode_to_buffer(codec.join_prefixed(model={"w": torch.zeros(2), "ids": torch.tensor([1, 3])})),
                        layout=update_layout(codec.layout_of(base), {}), client_id=2)
    with pytest.raises(WireError, match=r"'ids' moved by 1 in one round; at most 0"):
        check_integer_moves(got, base, max_steps=100, client_id=2)


def header(**changes: Any) -> dict[str, Any]:
    return {"train_seconds": 1.5, "train_loss": 0.3, "generation": None, **changes}


def test_reported_times_and_losses_must_be_finite() -> None:
    check_reports(header(train_loss=math.nan), client_id=1)  # no step taken: NaN is what an honest client reports
    check_reports(header(generation={"images": 3, "wall_seconds": 0.2, "cache_hit": False}), client_id=1)
    for bad, text in ((header(train_seconds=math.inf), "train_seconds = inf"), (header(train_seconds=-1.0), "train_seconds = -1.0"),
                      (header(train_loss=-math.inf), "train_loss = -inf"),
                      (header(generation={"images": 3, "wall_seconds": math.nan, "cache_hit": False}), "generation.wall_seconds = nan")):
        with pytest.raises(WireError, match=text):
            check_reports(bad, client_id=1)


# ---- the node's release ------------------------------------------------------------------------------------------


def test_a_node_of_an_older_release_or_another_model_is_refused_naming_both_sides() -> None:
    digest = versions.layout_digest(GLOBAL)
    versions.check_node(1, versions.NodeVersion(__version__, versions.PROTOCOL_VERSION, digest), expected_digest=digest)
    with pytest.raises(versions.VersionRefused, match=rf"client 1 runs a release before fedsynth 0.2.0 .* this coordinator runs "
                                                      rf"fedsynth {__version__}, protocol {versions.PROTOCOL_VERSION}"):
        versions.check_node(1, versions.NodeVersion("", 0, ""), expected_digest=digest)
    with pytest.raises(versions.VersionRefused, match=r"client 2 runs fedsynth 9.0.0, protocol 9; this coordinator runs"):
        versions.check_node(2, versions.NodeVersion("9.0.0", 9, digest), expected_digest=digest)
    with pytest.raises(versions.VersionRefused) as huge:  # a hostile release string is cut, not echoed whole
        versions.check_node(2, versions.NodeVersion("x" * 4_000_000, 9, digest), expected_digest=digest)
    assert len(str(huge.value)) < 300
    other = versions.layout_digest({**GLOBAL, "conv.weight": torch.zeros(4, 4)})
    with pytest.raises(versions.VersionRefused, match=rf"layout {other[:16]}, the coordinator's is {digest[:16]}"):
        versions.check_node(3, versions.NodeVersion(__version__, versions.PROTOCOL_VERSION, other), expected_digest=digest)


def test_the_layout_digest_sees_names_shapes_and_dtypes() -> None:
    digest = versions.layout_digest(GLOBAL)
    assert versions.layout_digest({k: v.clone() + 1 for k, v in GLOBAL.items()}) == digest  # values do not count
    assert versions.layout_digest({**GLOBAL, "conv.weight": torch.zeros(4, 3, dtype=torch.float16)}) != digest
    assert versions.layout_digest({"renamed": GLOBAL["conv.weight"], **{k: v for k, v in GLOBAL.items() if k != "conv.weight"}}) != digest


def test_a_run_spec_at_the_new_keys_defaults_reads_as_the_release_before_read_it() -> None:
    spec = json.loads(to_json(RunConfig()))
    assert "aggregation" not in spec["train"] and "max_refusals" not in spec["runtime"]
    assert "max_image_pixels" not in spec["data"] and "follow_symlinks" not in spec["data"]
    assert from_json(to_json(RunConfig())) == RunConfig()
    cfg = from_json(json.dumps({**spec, "train": {**spec["train"], "aggregation": "median"}}))
    assert json.loads(to_json(cfg))["train"]["aggregation"] == "median"
    assert cfg.fingerprint() != RunConfig().fingerprint()


# ---- the record of refusals -----------------------------------------------------------------------------------


def ledger(max_refusals: int = 2) -> RefusalLedger:
    return RefusalLedger(max_refusals, Counter("refused_total", "test", ["reason"], registry=CollectorRegistry()))


def test_refusals_in_a_row_exclude_their_client_and_an_accepted_update_resets_the_count() -> None:
    book = ledger()
    book.refuse(1, 3, "update from client 3: missing tensors []")
    book.refuse(1, 4, "update from client 4: tensor 'w' contains NaN or Inf")
    first = book.close_round(1, [0, 3, 4], [0])
    assert [(e["client"], e["reason"]) for e in first["refused"]] == [(3, "layout"), (4, "non_finite")]
    assert first["excluded"] == []
    book.refuse(2, 3, "update from client 3: missing tensors []")
    second = book.close_round(2, [0, 3, 4], [0, 4])  # client 4 answered: its count starts again
    assert [e["client"] for e in second["excluded"]] == [3] and set(book.excluded) == {3}
    book.refuse(3, 4, "update from client 4: tensor 'w' contains NaN or Inf")
    assert book.close_round(3, [0, 4], [0])["excluded"] == []


def test_stale_and_duplicate_uploads_are_named_but_never_exclude() -> None:
    book = ledger(max_refusals=1)
    book.refuse(1, 5, "update for round 0", reason="stale", counts=False)
    assert book.close_round(1, [5], [5])["excluded"] == []


def test_a_resumed_run_excludes_whom_the_run_before_it_had() -> None:
    book = ledger()
    history = []
    for number in (1, 2):
        book.refuse(number, 3, "update from client 3: missing tensors []")
        history.append({"round": number, "sampled": [0, 3], "participants": [0], **book.close_round(number, [0, 3], [0])})
    resumed = ledger()
    resumed.restore(history)
    assert resumed.excluded.keys() == book.excluded.keys() == {3}
    record = run_record(history)
    assert [(e["round"], e["client"]) for e in record["refused_updates"]] == [(1, 3), (2, 3)]
    assert [e["client"] for e in record["excluded_clients"]] == [3]


@pytest.mark.parametrize(("message", "reason"), [
    ("payload is not valid safetensors (header of 9 bytes exceeds the limit of 4)", "header"),
    ("update from client 1: tensor 'w' has dtype torch.float64, expected torch.float32", "dtype"),
    ("update from client 1: tensor 'w' contains NaN or Inf", "non_finite"),
    ("update from client 1: integer tensor 'n' moved by 9 in one round; at most 0", "range"),
    ("update from client 1: train_seconds = inf; must be a finite number >= 0", "report"),
    ("update from client 1: missing tensors ['b'] / unexpected tensors []", "layout"),
])
def test_each_refusal_is_counted_under_the_kind_of_defect_it_names(message: str, reason: str) -> None:
    assert reason_of(message) == reason
