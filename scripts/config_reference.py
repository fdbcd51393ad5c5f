"""Write docs/reference/config.md from fedsynth/config.py: every key's type, default, range and meaning.

    python scripts/config_reference.py            # rewrite docs/reference/config.md
    python scripts/config_reference.py --check    # exit 1 with a diff when the file is stale

Types and defaults come from the dataclass fields; ranges and choices from running each section's own `check()`
against a recorder (so a range is documented exactly where it is enforced); meanings from the comment beside or
above each field (or a section's docstring). A key without a comment is listed with a visible placeholder.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import io
import sys
import textwrap
import tokenize
import types
import typing
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedsynth import config as config_module  # noqa: E402
from fedsynth.config_schema import AGGREGATION_DEFAULTS, AGGREGATION_PARAMS, ALGORITHM_PARAMS, Bound, Section  # noqa: E402

OUT = ROOT / "docs" / "reference" / "config.md"
NO_DESCRIPTION = "**(no description: add a comment beside this field in fedsynth/config.py)**"

# Rules that a section's check() states in code of its own rather than through the Section helpers. A key whose check
# reads it outside the helpers and that is not listed here still gets "also checked in XConfig.check()".
EXTRA_RULES = {
    "generation.generator": "HOST:PORT, HOST:PORT,HOST:PORT,... (no repeats) or one dns:///NAME:PORT; ports 1..65535",
    "generation.prompt_template": "names `{name}` and no other field",
    "generation.evaluate_per_class": "0 (off) or >= 2",
    "runtime.heartbeat_s": "at most half of runtime.heartbeat_timeout_s",
    "runtime.heartbeat_timeout_s": ">= 2 x runtime.heartbeat_s",
}


NOT_RULES = {"key", "check", "_fail"}  # Section methods that state no range


@dataclasses.dataclass(frozen=True)
class Rule:
    """One range or choice rule on a key, as the Section helper that enforces it was called."""

    kind: str  # at_least, above, within, one_of, model_spec, non_empty, address, bounded, parameters_of
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()
    bound: Bound | None = None

    def text(self) -> str:
        if self.kind == "at_least":
            return f">= {_number(self.low)}"
        if self.kind == "above":
            return f"> {_number(self.low)}"
        if self.kind == "within":
            return f"{'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}{')' if self.high_open else ']'}"
        if self.kind == "one_of":
            return "one of " + ", ".join(f"`{choice}`" for choice in self.choices)
        if self.kind == "non_empty":
            return "not empty"
        if self.kind == "address":
            return "HOST:PORT, port 1..65535"
        if self.kind == "bounded":
            return str(self.bound)
        if self.kind == "model_spec":  # choices: the built-in names listed to users
            return ", ".join(f"`{choice}`" for choice in self.choices) + ", `torchvision:<builder>` or `package.module:factory`"
        if self.kind == "parameters_of":  # choices: the key whose table of parameters it is
            what = "rule" if self.choices == ("aggregation_params",) else "algorithm"
            return f"the chosen {what}'s parameters ([below](#train{self.choices[0] if self.choices else 'algorithm_params'}))"
        raise ValueError(f"unknown rule kind {self.kind!r}")


class RuleRecorder:
    """Stands in for a section inside its check(): the Section helpers record their rule instead of testing it;
    everything else (field values, key(), code of the section's own) reads the real section at its defaults."""

    def __init__(self, section: Any) -> None:
        self._section = section
        self.rules: dict[str, list[Rule]] = defaultdict(list)

    def __getattr__(self, name: str) -> Any:
        if name in vars(Section) and callable(vars(Section)[name]) and name not in NOT_RULES:
            raise NotImplementedError(f"Section.{name} is a range helper this script does not record yet: add it to "
                                      "RuleRecorder in scripts/config_reference.py")
        return getattr(self._section, name)

    def at_least(self, low: float, *names: str) -> None:
        for name in names:
            self.rules[name].append(Rule("at_least", low=low))

    def above(self, low: float, *names: str) -> None:
        for name in names:
            self.rules[name].append(Rule("above", low=low))

    def within(self, name: str, low: float, high: float, *, high_open: bool = False, low_open: bool = False) -> None:
        self.rules[name].append(Rule("within", low=low, high=high, low_open=low_open, high_open=high_open))

    def one_of(self, name: str, choices: tuple[str, ...]) -> None:
        self.rules[name].append(Rule("one_of", choices=tuple(choices)))

    def model_spec(self, name: str, builtins: tuple[str, ...], internal: tuple[str, ...] = ()) -> None:
        self.rules[name].append(Rule("model_spec", choices=tuple(builtins)))  # internal names are never listed

    def non_empty(self, *names: str) -> None:
        for name in names:
            self.rules[name].append(Rule("non_empty"))

    def address(self, name: str) -> None:
        self.rules[name].append(Rule("address"))

    def bounded(self, name: str, bound: Bound) -> None:
        self.rules[name].append(Rule("bounded", bound=bound))

    def parameters_of(self, algorithm: str, name: str, table: Any = None) -> None:
        self.rules[name].append(Rule("parameters_of", choices=(name,)))


HELPERS = {name for name in vars(RuleRecorder) if not name.startswith("_") and name != "rules"}


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    key: str
    type: str
    default: str
    range: str
    meaning: str
    rules: tuple[Rule, ...]


def _number(value: float | None) -> str:
    assert value is not None
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def describe_type(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [option for option in typing.get_args(hint) if option is not type(None)]
        text = " or ".join(describe_type(option) for option in options)
        return f"{text}, optional" if len(options) < len(typing.get_args(hint)) else text
    if typing.get_origin(hint) is dict:
        return f"table of {describe_type(typing.get_args(hint)[1])}"
    if typing.get_origin(hint) in (tuple, list):
        return f"list of {describe_type(typing.get_args(hint)[0])}"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(hint, getattr(hint, "__name__", str(hint)))


def toml_value(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, float):
        return _number(value) + ".0" if value.is_integer() and abs(value) < 1e15 else repr(value)
    return repr(value)


def field_comments(cls: type, prefix: str = "") -> dict[str, str]:
    """Each field's comment: the comment lines right above it (a blank line or code ends them), then the one on its
    line. A field with neither, on the line right after a field with comment lines above it, shares those lines:
    they describe a group of keys (e.g. a schema's classes, image size and channels)."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    trailing: dict[int, str] = {}
    standalone: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row = token.start[0]
            text = token.string.lstrip("#").strip()
            (standalone if lines[row - 1].lstrip().startswith("#") else trailing)[row] = text
    comments: dict[str, str] = {}
    class_node = ast.parse(source).body[0]
    assert isinstance(class_node, ast.ClassDef)
    group: tuple[str, str, int] | None = None  # (first key, its comment lines, the last line of the group's last field)
    for statement in class_node.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            group = None
            continue
        name = statement.target.id
        above = []
        row = statement.lineno - 1
        while row in standalone:
            above.insert(0, standalone[row])
            row -= 1
        own = [part for part in (" ".join(above), trailing.get(statement.lineno, "")) if part]
        end = statement.end_lineno or statement.lineno
        if own:
            comments[name] = "; ".join(own)
            group = (name, " ".join(above), end) if above else None
        elif group is not None and statement.lineno == group[2] + 1:
            comments[name] = f"With `{prefix}{group[0]}`: {group[1]}"
            group = (group[0], group[1], end)
        else:
            comments[name] = ""
            group = None
    return comments


def keys_checked_in_own_code(cls: type) -> set[str]:
    """Fields the section's check() reads outside the Section helpers (self.NAME, or self.key("NAME"))."""
    check = cls.__dict__.get("check")
    if check is None:
        return set()
    tree = ast.parse(textwrap.dedent(inspect.getsource(check)))
    names = {f.name for f in dataclasses.fields(cls)}
    inside_helpers: set[int] = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in HELPERS
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
            inside_helpers.update(id(child) for child in ast.walk(node))
    found = set()
    for node in ast.walk(tree):
        if id(node) in inside_helpers:
            continue
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in names:
            found.add(node.attr)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "key"
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in names):
            found.add(node.args[0].value)
    return found


def section_keys(cls: type, prefix: str) -> list[KeyDoc]:
    instance = cls()
    recorder = RuleRecorder(instance)
    cls.check(recorder)
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls, prefix)
    own_code = keys_checked_in_own_code(cls)
    docs = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            continue  # a section of the top level: listed under its own heading
        key = f"{prefix}{f.name}"
        rules = tuple(recorder.rules.get(f.name, ()))
        ranges = [rule.text() for rule in rules]
        if key in EXTRA_RULES:
            ranges.append(EXTRA_RULES[key])
        elif f.name in own_code:
            ranges.append(f"also checked in `{cls.__name__}.check()`")
        docs.append(KeyDoc(key=key, type=describe_type(hints[f.name]), default=toml_value(getattr(instance, f.name)),
                           range="; ".join(ranges) or "any", meaning=comments.get(f.name) or NO_DESCRIPTION,
                           rules=rules))
    return docs


def sections() -> list[tuple[str, type]]:
    """("", RunConfig) for the top level, then every [section] in the order the config reads them."""
    return [("", config_module.RunConfig), *config_module.SECTIONS.items()]


def all_keys() -> list[KeyDoc]:
    return [doc for name, cls in sections() for doc in section_keys(cls, f"{name}." if name else "")]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(docs: list[KeyDoc]) -> list[str]:
    rows = ["| key | type | default | range | meaning |", "|---|---|---|---|---|"]
    rows += [f"| `{d.key}` | {d.type} | `{_cell(d.default)}` | {_cell(d.range)} | {_cell(d.meaning)} |" for d in docs]
    return rows


def algorithm_defaults() -> dict[str, dict[str, Any]]:
    from fedsynth.algorithms import ALGORITHMS  # torch: only for the defaults, which live in the dataclasses

    return {name: {f.name: f.default for f in dataclasses.fields(cls)} for name, cls in ALGORITHMS.items()}


def render() -> str:
    defaults = algorithm_defaults()
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python scripts/config_reference.py` from fedsynth/config.py and fedsynth/config_schema.py;",
        "     do not edit by hand. `tests/test_config_reference.py` fails when this file is stale. -->",
        "",
        "Every key of the run config that `fedsynth run`, `fedsynth coordinator` and `fedsynth experiment` read: its",
        "type, its default, the values it accepts and what it means. Set keys in a TOML file (`--config FILE`, one",
        "`[section]` per table below, the top-level keys before any section) or on the command line with",
        "`--set section.key=value` (the value is read as TOML, else as a string). A wrong type, a value out of range,",
        "an unknown choice, key or section is one line naming `section.key` and the value, and exit 1 before any",
        "process starts. Clients receive the run config from the coordinator; they read no config file.",
        "",
        "\"optional\" keys may be left out (unset). Numbers must be finite; an integer is accepted where a number is",
        "wanted, `true`/`false` never.",
    ]
    for name, cls in sections():
        docs = section_keys(cls, f"{name}." if name else "")
        out += ["", f"## {'[' + name + ']' if name else 'Top level'}", ""]
        summary = inspect.getdoc(cls) or ""
        if summary and not summary.startswith(f"{cls.__name__}("):  # not the signature dataclass writes
            out += [summary.split("\n\n")[0].replace("\n", " "), ""]
        out += _table(docs)
    out += ["", "## train.algorithm_params", "",
            "`train.algorithm_params` is a table of the chosen `train.algorithm`'s parameters; any other name is refused",
            "(`fedsynth run --set train.algorithm=fedprox --set train.algorithm_params.mu=0.01`). Left out, a",
            "parameter keeps its default below.", ""]
    out += _parameters_table("algorithm", ALGORITHM_PARAMS, lambda algorithm, param: (
        "`data.clients`" if defaults[algorithm][param] is dataclasses.MISSING else f"`{toml_value(defaults[algorithm][param])}`"))
    out += ["", "## train.aggregation_params", "",
            "`train.aggregation_params` is a table of the chosen `train.aggregation` rule's parameters; any other name is",
            "refused (`--set train.aggregation=trimmed_mean --set train.aggregation_params.beta=0.2`). Left out, a",
            "parameter keeps its default below ([docs/security.md](../security.md#robust-aggregation)).", ""]
    out += _parameters_table("rule", AGGREGATION_PARAMS, lambda rule, param: f"`{toml_value(AGGREGATION_DEFAULTS[rule][param])}`")
    return "\n".join(out) + "\n"


def _parameters_table(what: str, table: dict[str, dict[str, Bound]], shown_default: Any) -> list[str]:
    """Rows of `| what | parameter | range | default |` for a table of named parameters and their bounds."""
    rows = [f"| {what} | parameter | range | default |", "|---|---|---|---|"]
    for name, params in table.items():
        if not params:
            rows.append(f"| `{name}` | (none) | | |")
        for param, bound in params.items():
            rows.append(f"| `{name}` | `{param}` | {bound} | {shown_default(name, param)} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 with a diff when the file is stale")
    parser.add_argument("--path", type=Path, default=OUT, help=f"the file to write or check (default {OUT.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.path.read_text() if args.path.is_file() else ""
        if current == text:
            return 0
        sys.stdout.writelines(difflib.unified_diff(current.splitlines(keepends=True), text.splitlines(keepends=True),
                                                   str(args.path), "generated"))
        print(f"{args.path} is stale: run python scripts/config_reference.py", file=sys.stderr)
        return 1
    args.path.parent.mkdir(parents=True, exist_ok=True)
    args.path.write_text(text)
    print(f"wrote {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
