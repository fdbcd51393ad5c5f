"""scripts/config_reference.py: docs/reference/config.md matches fedsynth/config.py, and the ranges it documents are
the ones the config enforces."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fedsynth.config import from_dict
from fedsynth.errors import ConfigError

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "config_reference.py"
_spec = importlib.util.spec_from_file_location("config_reference", SCRIPT)
assert _spec is not None and _spec.loader is not None
reference = importlib.util.module_from_spec(_spec)
sys.modules["config_reference"] = reference
_spec.loader.exec_module(reference)


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, check=False)


def test_the_checked_in_reference_is_up_to_date() -> None:
    result = run_script("--check")
    assert result.returncode == 0, f"{result.stderr}\n{result.stdout}"


def test_a_stale_reference_fails_the_check_with_a_diff(tmp_path: Path) -> None:
    stale = tmp_path / "config.md"
    stale.write_text(reference.render().replace("| `data.clients` | integer | `10`", "| `data.clients` | integer | `11`"))
    result = run_script("--check", "--path", str(stale))
    assert result.returncode == 1
    assert "-| `data.clients` | integer | `11`" in result.stdout and "+| `data.clients` | integer | `10`" in result.stdout
    assert "is stale" in result.stderr


def test_every_key_has_a_meaning() -> None:
    # A key added without a comment beside it in fedsynth/config.py shows the placeholder; say what it means there.
    undescribed = [doc.key for doc in reference.all_keys() if doc.meaning == reference.NO_DESCRIPTION]
    assert not undescribed, f"add a one-line comment beside these fields in fedsynth/config.py: {undescribed}"


def test_the_extra_rules_name_real_keys() -> None:
    keys = {doc.key for doc in reference.all_keys()}
    assert set(reference.EXTRA_RULES) <= keys


def outside(rule: Any, default: Any) -> list[Any]:
    """Values just outside a recorded rule, of the field's own type (an int field gets ints)."""
    step = 1 if isinstance(default, int) and not isinstance(default, bool) else 0.5
    cast = int if step == 1 else float
    if rule.kind == "at_least":
        return [cast(rule.low - step)]
    if rule.kind == "above":
        return [cast(rule.low)]
    if rule.kind == "within":
        return [cast(rule.low if rule.low_open else rule.low - step), cast(rule.high if rule.high_open else rule.high + step)]
    if rule.kind == "one_of":
        return ["no-such-choice"]
    if rule.kind == "non_empty":
        return ["  "]
    return []


def documented_violations() -> list[tuple[str, Any]]:
    cases = []
    for doc in reference.all_keys():
        section, _, name = doc.key.rpartition(".")
        cls = reference.config_module.SECTIONS[section] if section else reference.config_module.RunConfig
        default = getattr(cls(), name)
        if default is None:  # optional: a number's rule applies to a value, so start from a typical one
            default = "" if "string" in doc.type else 1
        for rule in doc.rules:
            cases += [(doc.key, value) for value in outside(rule, default)]
    return cases


@pytest.mark.parametrize(("key", "value"), documented_violations())
def test_a_value_outside_the_documented_range_is_refused_naming_the_key(key: str, value: Any) -> None:
    section, _, name = key.rpartition(".")
    raw = {section: {name: value}} if section else {name: value}
    with pytest.raises(ConfigError, match=f"^{key.replace('.', '[.]')}"):
        from_dict(raw)


@dataclass(frozen=True)
class Commented:
    first: int = 1  # its own comment
    # One comment for a group of keys:
    # it goes on over two lines.
    grouped: int = 2
    follower: int = 3

    alone: int = 4
    last: int = 5  # after a key without one


def test_meanings_come_from_the_comment_beside_or_above_and_a_group_shares_its_comment() -> None:
    assert reference.field_comments(Commented, "x.") == {
        "first": "its own comment",
        "grouped": "One comment for a group of keys: it goes on over two lines.",
        "follower": "With `x.grouped`: One comment for a group of keys: it goes on over two lines.",
        "alone": "",  # a blank line ends the group: the reference shows the placeholder
        "last": "after a key without one",
    }
