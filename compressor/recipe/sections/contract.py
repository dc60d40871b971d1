"""What a recipe section is: its key, its options class and the checks past types and ranges.

A section is the recipe-side half of a run's stage (`stages`): the stage declares the section
it reads, and the section says what a valid one is. Each built-in section lives in its own module
here, beside its options class (the code below `run/` that reads the options imports them from
there); `recipe.schema` assembles the recipe from them (`order.BUILTIN_SECTIONS`), and a plugin
stage's section is checked by its own options class the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compressor.errors import UserError

if TYPE_CHECKING:
    from compressor.recipe.schema import Recipe
    from compressor.strategies.registry import PluginRegistry


@dataclass(frozen=True)
class SectionContext:
    """What a section's check may consult besides the recipe: the recipe file's folder (relative
    paths resolve against it) and the registered plugins (strategies, selectors)."""

    base: Path
    registry: PluginRegistry


Check = Callable[[Any, "Recipe", SectionContext], Any]
"""(the section's options, the recipe as checked so far, the context) -> the options completed
(paths resolved, defaults taken from other sections); a problem is a one-line UserError."""


@dataclass(frozen=True)
class Section:
    """One top-level key of a recipe that a stage reads."""

    key: str
    """The recipe key (`refinement`), the stage's `section`."""
    options: type
    """Its options class: a pydantic dataclass (`compressor.validation.options`), whose types and
    bounds the recipe's check and JSON schema read."""
    check: Check | None = None
    """What types and ranges cannot say (files exist, keys agree with other sections); run in the
    order of `order.BUILTIN_SECTIONS`, only when the recipe has the section."""
    shorthand: Callable[[Any], Any] | None = None
    """The raw value as written, in the form the options class reads (a shorthand the YAML allows)."""
    schema_edit: Callable[[dict[str, Any]], None] | None = None
    """Edits the JSON schema's `$defs` to admit the shorthand."""


def refuse_choice_keys(
    section: str,
    spec: Any,
    keys: Sequence[str],
    chooses: str,
    count: str = "kept",
    idle: Mapping[str, tuple[Any, ...]] | None = None,
) -> None:
    """A section whose `count` (`kept`; `removed` for depth) fixes the count the run would otherwise
    choose (`mlp`, `experts`, `heads`, `depth`): each of the choice's `keys` away from its default
    is refused in one line, unless its value is one of those `idle` names for it (values that mean
    nothing where the count is fixed, such as `auto` or `null`)."""
    fixed = type(spec)(**{count: getattr(spec, count)})
    idle = idle or {}
    for key in keys:
        value = getattr(spec, key)
        if value != getattr(fixed, key) and value not in idle.get(key, ()):
            raise UserError(
                f"{section}.{key} applies when {chooses}, but {section}.{count} fixes it; remove one of them"
            )
