"""Recipe and strategy options validated by pydantic, reported as one line.

Options are pydantic dataclasses (`options`: unknown keys forbidden, strict types: a string is
never read as a number, nor a number as a boolean); `check` validates a raw mapping against one,
and the first problem pydantic finds becomes a one-line `UserError` that names the key as a
dotted path, what is expected, the field's meaning (its description) and the value given.
"""

from __future__ import annotations

import dataclasses
import reprlib
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import AllowInfNan, ConfigDict, Field, Strict, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass as options  # noqa: F401  (re-exported: `@options(config=FORBID)`)
from pydantic.fields import FieldInfo

from compressor.errors import UserError, did_you_mean

FORBID = ConfigDict(extra="forbid")
"""The config of every options class: a key that is not a field is an error."""

Number = Annotated[float, Strict(), AllowInfNan(False)]
"""A finite number: an integer or a float, never a string, a boolean, .inf or .nan (no setting
means anything at infinity: an unbounded one would run for ever or overflow later)."""

SHOWN = reprlib.Repr()
"""How a message shows a bad value: a few items and characters of it, whatever its size (a
YAML alias tree expands to billions of items when printed whole)."""
SHOWN.maxstring, SHOWN.maxother, SHOWN.maxlong, SHOWN.maxlevel = 60, 60, 40, 3


def shown(value: Any) -> str:
    """`value` as a message quotes it: its repr, cut short."""
    return SHOWN.repr(value)


T = TypeVar("T")
UNKNOWN_KEY = ("unexpected_keyword_argument", "extra_forbidden")

_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "dict_type": "a mapping",
    "dataclass_type": "a mapping",
    "model_type": "a mapping",
    "mapping_type": "a mapping",
    "list_type": "a list",
}
_BOUNDS = {
    "greater_than_equal": ("ge", "at least"),
    "greater_than": ("gt", "above"),
    "less_than": ("lt", "below"),
    "less_than_equal": ("le", "at most"),
}


def _strip(tp: Any) -> Any:
    """`tp` without Annotated[...] and Optional[...] around it."""
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        else:
            return tp


def _element(tp: Any) -> Any:
    """The (still annotated) item type of a list or tuple type; any other type as it is."""
    bare = _strip(tp)
    return typing.get_args(bare)[0] if typing.get_origin(bare) in (list, tuple) else tp


def _owner(cls: type, loc: tuple[Any, ...]) -> Any:
    """The options class holding the field at `loc` (None where the path leaves options classes)."""
    owner: Any = cls
    while loc and isinstance(loc[-1], int):  # an item's error: the field holding the list
        loc = loc[:-1]
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if not dataclasses.is_dataclass(owner) or part not in {f.name for f in dataclasses.fields(owner)}:
            return None
        owner = _strip(_element(typing.get_type_hints(owner, include_extras=True)[part]))
    return owner


def _metadata(owner: Any, loc: tuple[Any, ...]) -> list[Any]:
    """The `described(...)` metadata (pydantic FieldInfo objects) of the field at the end of
    `loc`, or of its items where `loc` ends with an index."""
    names = [part for part in loc if isinstance(part, str)]
    if not dataclasses.is_dataclass(owner) or not names:
        return []
    tp = typing.get_type_hints(owner, include_extras=True).get(names[-1])
    if isinstance(loc[-1], int):
        tp = _element(tp)
    found, pending = [], [tp]
    while pending:
        tp = pending.pop()
        if typing.get_origin(tp) is Annotated:
            found += [extra for extra in typing.get_args(tp)[1:] if isinstance(extra, FieldInfo)]
            pending.append(typing.get_args(tp)[0])
        elif typing.get_origin(tp) in (typing.Union, types.UnionType):
            pending.extend(typing.get_args(tp))
    return found


def _nullable(owner: Any, loc: tuple[Any, ...]) -> bool:
    """Whether the field at the end of `loc` may be null."""
    if not dataclasses.is_dataclass(owner) or not loc or not isinstance(loc[-1], str):
        return False
    hint = typing.get_type_hints(owner).get(loc[-1])
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def _description(owner: Any, loc: tuple[Any, ...]) -> str:
    """` (meaning)` from the field's `described(...)` metadata, or nothing."""
    text = next((info.description for info in _metadata(owner, loc) if info.description), None)
    return f" ({text})" if text else ""


def _range(owner: Any, loc: tuple[Any, ...]) -> str | None:
    """The field's bounds in words: "in [0, 1)", "at least 1", "above 0"."""
    bounds: dict[str, Any] = {}
    for info in _metadata(owner, loc):
        for item in info.metadata:
            for key in ("ge", "gt", "le", "lt"):
                if getattr(item, key, None) is not None:
                    bounds[key] = getattr(item, key)
    low = ("[", bounds["ge"]) if "ge" in bounds else ("(", bounds["gt"]) if "gt" in bounds else None
    high = (bounds["le"], "]") if "le" in bounds else (bounds["lt"], ")") if "lt" in bounds else None
    if low and high:
        return f"in {low[0]}{low[1]:g}, {high[0]:g}{high[1]}"
    words = {"ge": "at least", "gt": "above", "le": "at most", "lt": "below"}
    return next((f"{words[key]} {bounds[key]:g}" for key in words if key in bounds), None)


def _field_loc(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A pydantic error's location without its validators' and union members' tags
    (`function-after[...]`, `constrained-int`, `literal['auto']`): the keys and indices a user wrote."""
    return tuple(part for part in loc if isinstance(part, int) or not _tag(str(part)))


_UNION_TAGS = ("function-", "constrained-", "literal[", "list[", "dict[", "tuple[")
_TYPE_TAGS = {"int", "float", "str", "bool", "none"}


def _tag(part: str) -> bool:
    """A location part that pydantic added (a validator's or a union member's name), not a key."""
    return part.startswith(_UNION_TAGS) or part in _TYPE_TAGS


def _alternatives(errors: list[Any], loc: tuple[Any, ...], owner: Any, kind: str) -> str:
    """`, or auto or null`: the literal values a union field also takes, where its first error is another
    member's (a number out of range), so the message names every form the field accepts."""
    if kind == "literal_error":
        return ""
    words = [
        str(e["ctx"]["expected"]).replace("'", "")
        for e in errors
        if e["type"] == "literal_error" and _field_loc(e["loc"]) == loc and e.get("ctx")
    ]
    if not words:
        return ""
    return ", or " + " or ".join([*words, *(["null"] if _nullable(owner, loc) else [])])


def message(error: ValidationError, cls: type, prefix: str = "") -> str:
    """One line for the first problem of `error`, raised validating `cls`; `prefix` goes before
    every key (e.g. "--set " or a strategy's name)."""
    errors = error.errors()
    first = next((e for e in errors if e["type"] in UNKNOWN_KEY), errors[0])  # a misspelt key also goes missing
    loc = _field_loc(first["loc"])
    key = ".".join(str(part) for part in loc)
    kind, value, ctx = first["type"], first.get("input"), first.get("ctx") or {}
    owner = _owner(cls, loc) if loc else None
    meaning = _description(owner, loc) + _alternatives(errors, loc, owner, kind)
    where = f"{prefix}{key}" if key else (prefix.strip() or "the recipe")
    if kind in UNKNOWN_KEY:
        parent = ".".join(str(part) for part in loc[:-1])
        names = [f.name for f in dataclasses.fields(owner)] if dataclasses.is_dataclass(owner) else []
        return (
            f"unknown key '{prefix}{key}'{did_you_mean(str(loc[-1]), names)}; "
            f"allowed keys{' in ' + parent if parent else ''}: {', '.join(names)}"
        )
    if kind == "missing":
        return f"missing key '{prefix}{key}'"
    if kind == "literal_error":
        expected = str(ctx.get("expected", "")).replace("'", "").replace(" or ", ", ")
        return f"{where} must be {'null or ' if _nullable(owner, loc) else ''}one of {expected}, got {shown(value)}"
    if kind in _BOUNDS:
        bound, words = _BOUNDS[kind]
        expected = _range(owner, loc) or f"{words} {ctx.get(bound)}"
        return f"{where} must be {expected}{meaning}, got {shown(value)}"
    if kind == "too_short":
        return f"{where} must not be empty{meaning}"
    if kind == "string_pattern_mismatch":
        return f"{where} must be{meaning.replace(' (', ' ', 1).rstrip(')') or ' of the right form'}, got {shown(value)}"
    if kind in _EXPECTED:
        return f"{where} must be {_EXPECTED[kind]}{meaning}, got {shown(value)}"
    if kind == "value_error":
        return f"{where}: {first['msg'].removeprefix('Value error, ')}"
    return f"{where}: {first['msg']}, got {shown(value)}"


def check(cls: type[T], raw: Any, prefix: str = "") -> T:
    """`raw` (a mapping from YAML) as an instance of the options class `cls`, or a one-line UserError."""
    if not isinstance(raw, Mapping):
        raise UserError(f"{prefix.strip() or 'the recipe'} must be a mapping, got {shown(raw)}")
    try:
        return TypeAdapter(cls).validate_python(dict(raw))
    except ValidationError as error:
        raise UserError(message(error, cls, prefix)) from None


def described(description: str, **bounds: Any) -> Any:
    """A field's metadata: its meaning (quoted in messages and the JSON schema) and its bounds."""
    return Field(description=description, **bounds)


def replaced(instance: T, prefix: str = "", **changes: Any) -> T:
    """`dataclasses.replace` on an options instance with values from a user (command-line flags,
    say): a bad value is a one-line UserError whose key starts with `prefix`."""
    try:
        return dataclasses.replace(instance, **changes)  # type: ignore[type-var]
    except ValidationError as error:
        raise UserError(message(error, type(instance), prefix)) from None
