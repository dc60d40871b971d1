"""Reading a recipe: YAML as the 1.2 core schema reads it, bounded (no alias bombs, no integers
longer than any setting, no key given twice), and `--set` overrides on the raw mapping. What the
values mean is the sections' business (`recipe.sections`); this module knows only YAML.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from compressor.errors import UserError


class RecipeLoader(yaml.SafeLoader):
    """YAML as the 1.2 core schema reads it: only true/false are booleans (`yes`, `on`, `n` stay
    strings, so a misspelt value is refused rather than read as another type), `1e-3` is a number,
    and `010` or `1:30` are not octal or sexagesimal numbers."""


RecipeLoader.yaml_implicit_resolvers = {
    first: [
        (tag, regexp)
        for tag, regexp in resolvers
        if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _tag, _pattern, _first in (
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
    (
        "tag:yaml.org,2002:float",
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
        "-+0123456789.",
    ),
):
    RecipeLoader.add_implicit_resolver(_tag, re.compile(_pattern), list(_first))


MAX_DIGITS = 40
"""The longest integer a recipe may write (no setting takes more than 64 bits)."""

MAX_VALUES = 100_000
"""The most values a recipe may expand to (a recipe holds hundreds; YAML aliases can make billions)."""


class _Core12Constructor:
    """Ints in the 1.2 core forms (decimal, 0o octal, 0x hex); floats with an exponent and no dot.
    A scalar that is not what its tag says (`!!int 1.5`, `!!float abc`), an integer longer than
    any setting, and a key given twice are YAML errors at their line, not Python exceptions."""

    @staticmethod
    def int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
        text = str(loader.construct_scalar(node))
        if len(text.lstrip("+-")) > MAX_DIGITS:
            raise _bad(node, f"an integer of {len(text.lstrip('+-'))} digits, longer than any setting takes")
        try:
            return int(text, 0) if text.lstrip("+-").startswith(("0o", "0x")) else int(text)
        except ValueError:
            raise _bad(node, f"{text[:40]!r} is tagged as an integer but is not one") from None

    @staticmethod
    def float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
        text = str(loader.construct_scalar(node)).lower()
        try:
            return float(text.replace(".inf", "inf").replace(".nan", "nan"))
        except ValueError:
            raise _bad(node, f"{text[:40]!r} is tagged as a number but is not one") from None

    @staticmethod
    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
        seen: dict[str, yaml.Node] = {}
        for key_node, _ in node.value:  # the keys as written (a merge key's `<<` brings keys it may override)
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            if key_node.value in seen:
                line = seen[key_node.value].start_mark.line + 1
                raise _bad(key_node, f"the key '{key_node.value}' is given twice (first at line {line}); keep one")
            seen[key_node.value] = key_node
        return loader.construct_mapping(node)


def _bad(node: yaml.Node, problem: str) -> yaml.constructor.ConstructorError:
    return yaml.constructor.ConstructorError(None, None, problem, node.start_mark)


RecipeLoader.add_constructor("tag:yaml.org,2002:int", _Core12Constructor.int)
RecipeLoader.add_constructor("tag:yaml.org,2002:float", _Core12Constructor.float)
RecipeLoader.add_constructor("tag:yaml.org,2002:map", _Core12Constructor.mapping)


def parse_yaml(text: str) -> Any:
    """`text` read as YAML with `RecipeLoader` (recipes, sweep files and --set values alike): YAML
    errors as `yaml.YAMLError`, nesting too deep for the parser and values expanded past
    `MAX_VALUES` (aliases) included."""
    try:
        value = yaml.load(text, Loader=RecipeLoader)  # noqa: S506 (a SafeLoader)
    except RecursionError:
        raise yaml.YAMLError("it is nested too deeply to read") from None
    if _values(value) > MAX_VALUES:
        raise yaml.YAMLError(
            f"it expands to more than {MAX_VALUES:,} values (YAML aliases?), more than any recipe holds"
        )
    return value


def _values(value: Any) -> int:
    """How many values `value` holds, counted as far as `MAX_VALUES` + 1 (an alias counts again
    wherever it is used, as every reader of the recipe would see it)."""
    count, pending = 0, [value]
    while pending and count <= MAX_VALUES:
        item = pending.pop()
        count += 1
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return count


def dotted(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys (lists stay values), as `--set` and sweep grids name them."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            flat.update(dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one `--set dotted.key=value` (value parsed as YAML) to the raw recipe."""
    key, sep, text = assignment.partition("=")
    if not sep or not key:
        raise UserError(f"--set expects KEY=VALUE, got '{assignment}'")
    try:
        value = parse_yaml(text) if text else None
    except yaml.YAMLError as error:
        raise UserError(
            f"--set {key}: the value is not valid YAML ({getattr(error, 'problem', None) or error})"
        ) from None
    assign(raw, key, value, "--set ")


def assign(raw: dict[str, Any], key: str, value: Any, where: str = "") -> None:
    """Set the dotted `key` (list items by index) of a raw recipe to `value`; `where` prefixes errors."""
    parts = key.split(".")
    node: Any = raw
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        here = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) > len(node):
                raise UserError(f"{where}{key}: '{here}' needs a list index from 0 to {len(node)}")
            index = int(part)
            if index == len(node):
                node.append({} if not last else value)
            if last:
                node[index] = value
            node = node[index]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise UserError(f"{where}{key}: '{'.'.join(parts[:depth])}' is not a mapping or list")


def read_yaml(path: Path, what: str) -> Any:
    """A YAML file's contents; a missing file or bad YAML is a one-line UserError."""
    if path.is_dir():
        raise UserError(f"{path} is a folder; give the {what} file, e.g. {path / 'demo.yaml'}")
    if not path.is_file():
        raise UserError(f"{what} file not found: {path}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        kind = "a gzip file" if data.startswith(b"\x1f\x8b") else "not UTF-8 text"
        raise UserError(
            f"{what} {path} is {kind} (byte 0x{data[error.start]:02x} at offset {error.start}); "
            f"give a YAML file saved as UTF-8"
        ) from None
    if "\x00" in text:
        raise UserError(f"{what} {path} holds NUL bytes, so it is not a YAML text file; give a YAML file")
    try:
        return parse_yaml(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise UserError(f"{what} {path} is not valid YAML{where}: {problem}") from None
