"""A seeded generator of bad (and borderline) recipes, read from the live recipe schema and the
project's recipes, so a new stage's options are fuzzed the day they land.

Each `Case` is a recipe file's bytes, `--set` overrides, and optionally a replaced `config.json`,
with `must_refuse` saying whether any correct reading of it must end in the one-line error
(exit code 2). Cases that may be valid (an optional key deleted, a value at its bound, a huge
count, another choice of an enum) only have to end within bounds: exit code 0, or one line and 2.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from compressor.recipe.schema import recipe_schema
from compressor.strategies.registry import PluginRegistry


@dataclass(frozen=True)
class Case:
    """One generated input to `compress run --dry-run`."""

    name: str
    text: bytes
    must_refuse: bool
    overrides: tuple[str, ...] = ()
    config: Any = field(default=None)
    """A replacement for the model's config.json: a JSON value, or bytes written as they are."""
    category: str = ""
    names: str | None = None
    """The key a refusal's line must name: the one setting this case changed."""


WRONG_FOR: dict[str, list[Any]] = {
    "number": ["abc", [1, 2], {"x": 1}],
    "integer": ["abc", 1.5, [1], {"x": 1}],
    "boolean": ["maybe", 2, [True]],
    "string": [[1, 2], {"x": "y"}],
    "array": [{"x": 1}, "abc-not-a-list"],
    "object": [7, [1, 2], "abc-not-a-mapping"],
}
"""Values no lax reading turns into the type (pydantic takes "3" as 3 and 1 as True)."""

OPTIONAL_DELETIONS = 6
"""Optional keys deleted per shipped recipe (a seeded sample: each one is a full dry run)."""

NON_FINITE = [float("inf"), float("-inf"), float("nan")]
HUGE = {"integer": 10**15, "number": 1e300}
ANCHOR_TREE = (
    "["
    + ", ".join(["&a0 [x,x,x,x,x,x,x,x,x]"] + [f"&a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)])
    + "]"
)
"""Nine levels of nine aliases ("billion laughs"): 387 million strings once expanded."""


class Schema:
    """The recipe's JSON schema with `$ref`s and optional (`anyOf` with null) branches resolved."""

    def __init__(self, registry: PluginRegistry) -> None:
        self.root = recipe_schema(registry)
        self.definitions = self.root["$defs"]

    def resolve(self, node: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """The node's own schema (a `$ref` followed, a single non-null `anyOf` branch taken) and
        whether null is allowed."""
        nullable = False
        if "anyOf" in node:
            branches = [b for b in node["anyOf"] if b.get("type") != "null"]
            nullable = len(branches) < len(node["anyOf"])
            if len(branches) == 1:
                node = {**branches[0], **{k: v for k, v in node.items() if k != "anyOf"}}
        if "$ref" in node:
            node = {
                **self.definitions[node["$ref"].rsplit("/", 1)[1]],
                **{k: v for k, v in node.items() if k != "$ref"},
            }
        return node, nullable

    def leaves(
        self, node: dict[str, Any] | None = None, path: tuple[str, ...] = ()
    ) -> Iterator[tuple[tuple[str, ...], dict[str, Any], bool, bool]]:
        """(path, schema, nullable, required) of every property of every mapping, depth first;
        mappings themselves included. Lists of mappings are entered at index 0."""
        node = self.root if node is None else node
        required = set(node.get("required", ()))
        for key, sub in node.get("properties", {}).items():
            resolved, nullable = self.resolve(sub)
            yield (*path, key), resolved, nullable, key in required
            if resolved.get("type") == "object" or "properties" in resolved:
                yield from self.leaves(resolved, (*path, key))
            items = resolved.get("items")
            if isinstance(items, dict) and "$ref" in items:
                yield from self.leaves(self.resolve(items)[0], (*path, key, "0"))

    def objects(self) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
        """Every closed mapping (no extra keys allowed) and its path."""
        yield (), self.root
        for path, node, _, _ in self.leaves():
            if node.get("additionalProperties") is False:
                yield path, node

    def strategies(self) -> list[dict[str, Any]]:
        return self.root["properties"]["pipeline"]["items"]["oneOf"]


def first_wrong(node: dict[str, Any]) -> str | None:
    """The first wrong-type mutation `Generator._mutations` names for `node`."""
    kind = _type(node)
    return f"wrong type {WRONG_FOR[kind][0]!r}" if kind in WRONG_FOR else None


def _type(node: dict[str, Any]) -> str | None:
    if "enum" in node or "const" in node:
        return "enum"
    kind = node.get("type")
    if kind is None and "properties" in node:
        return "object"
    return kind if isinstance(kind, str) else None


def _set(recipe: dict[str, Any], path: tuple[str, ...], value: Any, fill: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    """A copy of `recipe` with `path` set to `value`, absent parents created (a list's first item
    from `fill`, which holds what a parent needs to be read at all)."""
    recipe = json.loads(json.dumps(recipe))
    node: Any = recipe
    for depth, key in enumerate(path[:-1]):
        child_path = path[: depth + 1]
        if isinstance(node, list):
            index = int(key)
            while len(node) <= index:
                node.append(json.loads(json.dumps(fill.get(child_path, {}))))
            node = node[index]
        else:
            if not isinstance(node.get(key), (dict, list)):
                node[key] = json.loads(json.dumps(fill.get(child_path, {})))
            node = node[key]
    if isinstance(node, list):
        node[int(path[-1])] = value
    else:
        node[path[-1]] = value
    return recipe


def _delete(recipe: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    recipe = json.loads(json.dumps(recipe))
    node: Any = recipe
    for key in path[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    del node[path[-1]]
    return recipe


def _paths(value: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every key path of a parsed recipe (list items by index)."""
    if isinstance(value, dict):
        for key, sub in value.items():
            yield (*path, key)
            yield from _paths(sub, (*path, key))
    elif isinstance(value, list):
        for index, sub in enumerate(value):
            if isinstance(sub, (dict, list)):
                yield from _paths(sub, (*path, str(index)))


def dump(recipe: Any) -> bytes:
    return yaml.safe_dump(recipe, sort_keys=False, allow_unicode=True).encode()


def _out_of_range(node: dict[str, Any], integer: bool) -> list[Any]:
    step = 1 if integer else 0.5
    values = []
    if "minimum" in node:
        values.append(node["minimum"] - step)
    if "exclusiveMinimum" in node:
        values.append(node["exclusiveMinimum"])
    if "maximum" in node:
        values.append(node["maximum"] + step)
    if "exclusiveMaximum" in node:
        values.append(node["exclusiveMaximum"])
    return values


def _at_bounds(node: dict[str, Any], integer: bool) -> list[Any]:
    values = [node[k] for k in ("minimum", "maximum") if k in node]
    if "exclusiveMinimum" in node:
        values.append(node["exclusiveMinimum"] + (1 if integer else 1e-9))
    if "exclusiveMaximum" in node:
        values.append(node["exclusiveMaximum"] - (1 if integer else 1e-9))
    return values


class Generator:
    """All generated cases from a base recipe (valid, fast to check) and the project's recipes."""

    def __init__(
        self,
        registry: PluginRegistry,
        base: dict[str, Any],
        fill: dict[tuple[str, ...], Any],
        shipped: list[dict[str, Any]],
        config: dict[str, Any],
        seed: int = 0,
    ) -> None:
        self.schema = Schema(registry)
        self.base = base
        self.fill = fill
        self.shipped = shipped
        self.config = config
        self.random = random.Random(seed)

    def cases(self) -> list[Case]:
        found = [
            *self.values(),
            *self.strategy_options(),
            *self.unknown_keys(),
            *self.shipped_recipes(),
            *self.files(),
            *self.overrides(),
            *self.configs(),
            *self.paths(),
        ]
        names = [case.name for case in found]
        assert len(names) == len(set(names)), "case names are unique"
        return found

    def _case(self, category: str, name: str, recipe: Any, must_refuse: bool, **extra: Any) -> Case:
        return Case(f"{category}: {name}", dump(recipe), must_refuse, category=category, **extra)

    def _mutations(self, node: dict[str, Any], nullable: bool) -> Iterator[tuple[str, Any, bool]]:
        """(what, value, must_refuse) for one setting of schema `node`."""
        kind = _type(node)
        if kind == "enum":
            choices = node.get("enum", [node.get("const")])
            yield "not one of its choices", "not-a-choice", True
            for choice in choices:
                yield f"choice {choice!r}", choice, False
            return
        if kind in ("number", "integer"):
            integer = kind == "integer"
            for value in WRONG_FOR[kind]:
                yield f"wrong type {value!r}", value, True
            for value in NON_FINITE:
                yield f"non-finite {value}", value, True
            for value in _out_of_range(node, integer):
                yield f"out of range {value}", value, True
            for value in _at_bounds(node, integer):
                yield f"at its bound {value}", value, False
            yield "huge", HUGE[kind], False
            yield "billion laughs", ANCHOR_TREE, True
        elif kind in WRONG_FOR:
            for value in WRONG_FOR[kind]:
                yield f"wrong type {value!r}", value, True
            if kind == "array":
                items, _ = (node.get("items") or {}), None
                item_kind = _type(items) if isinstance(items, dict) else None
                if item_kind in WRONG_FOR:
                    yield "an item of the wrong type", [WRONG_FOR[item_kind][-1]], True
                if node.get("minItems", 0) >= 1:
                    yield "empty", [], True
            if kind == "string" and "pattern" in node:
                yield "against its pattern", "no such value!", True
        if not nullable:
            yield "null", None, kind not in ("object",)  # an empty section may mean its defaults

    def values(self) -> Iterator[Case]:
        """Every schema setting, set to wrong types, non-finite, out-of-range and bound values."""
        for path, node, nullable, _ in self.schema.leaves():
            if path[0] == "pipeline":
                continue  # each strategy's options: `strategy_options`
            for what, value, must_refuse in self._mutations(node, nullable):
                dotted = ".".join(path)
                if value is ANCHOR_TREE:
                    text = dump(_set(self.base, path, "ANCHOR", self.fill)).replace(b"ANCHOR", ANCHOR_TREE.encode())
                    yield Case(f"value: {dotted} {what}", text, True, category="value")
                else:
                    recipe = _set(self.base, path, value, self.fill)
                    yield self._case("value", f"{dotted} {what}", recipe, must_refuse, names=path[-1])

    def strategy_options(self) -> Iterator[Case]:
        """Each registered strategy's options, mutated as `values` mutates the sections."""
        for step in self.schema.strategies():
            name = step["properties"]["strategy"]["const"]
            for option, sub in step["properties"].items():
                if option == "strategy":
                    continue
                node, nullable = self.schema.resolve(sub)
                for what, value, must_refuse in self._mutations(node, nullable):
                    if value is ANCHOR_TREE:
                        continue
                    pipeline = [{"strategy": "pca"}] if name == "stiefel" else []
                    pipeline.append({"strategy": name, option: value})
                    yield self._case(
                        "strategy",
                        f"{name}.{option} {what}",
                        {**self.base, "pipeline": pipeline},
                        must_refuse,
                        names=option,
                    )
        yield self._case("strategy", "unknown strategy", {**self.base, "pipeline": [{"strategy": "pcaa"}]}, True)
        yield self._case("strategy", "empty pipeline", {**self.base, "pipeline": []}, True)

    def unknown_keys(self) -> Iterator[Case]:
        """A misspelt and an invented key in every closed mapping; every top-level key twice."""
        for path, node in self.schema.objects():
            keys = list(node.get("properties", {}))
            for key in ("no_such_key", *(f"{k}s" for k in keys[:2])):
                if key in keys:
                    continue
                dotted = ".".join((*path, key))
                yield self._case("unknown", dotted, _set(self.base, (*path, key), 1, self.fill), True, names=key)
        for key in self.base:
            text = dump(self.base) + dump({key: self.base[key]})
            yield Case(f"duplicate: {key}", text, True, category="duplicate")

    def shipped_recipes(self) -> Iterator[Case]:
        """The project's recipes (on the tiny model and local data), as they are and with each key
        deleted in turn: deleting a required key must be refused."""
        required = {path for path, _, _, req in self.schema.leaves() if req} | {
            (key,) for key in self.schema.root["required"]
        }
        for index, recipe in enumerate(self.shipped):
            yield self._case("shipped", f"{index} as it is", recipe, False)
            optional = []
            for path in _paths(recipe):
                generic = tuple("0" if part.isdigit() else part for part in path)
                if generic in required or path[-1] in ("strategy", "data_files"):  # json reads only the files named
                    yield self._case("shipped", f"{index} without {'.'.join(path)}", _delete(recipe, path), True)
                else:
                    optional.append(path)
            for path in self.random.sample(optional, min(OPTIONAL_DELETIONS, len(optional))):
                yield self._case("shipped", f"{index} without {'.'.join(path)}", _delete(recipe, path), False)

    def files(self) -> Iterator[Case]:
        """Files that are not a recipe: not UTF-8, not YAML, not a mapping, truncated."""
        text = dump(self.base)
        raw = {
            "empty": b"",
            "a comment alone": b"# nothing here\n",
            "a list": b"- model\n- output\n",
            "a scalar": b"42\n",
            "latin-1 byte in a comment": text + b"# caf\xe9\n",
            "UTF-16": text.decode().encode("utf-16"),
            "gzip": gzip.compress(text),
            "NUL byte": text + b"\x00\n",
            "random bytes": self.random.randbytes(512),
            "unclosed flow mapping": text + b"slicing: {layout: global\n",
            "tab indentation": text + b"slicing:\n\tlayout: global\n",
            "a tag that lies (!!float)": text + b"seed: !!float abc\n",
            "a tag that lies (!!int)": text + b"seed: !!int 1.5\n",
            "a python tag": text + b"seed: !!python/object/apply:os.system [ls]\n",
            "an integer of 5,000 digits": text.replace(b"seed: 0", b"") + b"seed: " + b"9" * 5000 + b"\n",
            "5,000 levels of nesting": text + b"slicing: " + b"[" * 5000 + b"]" * 5000 + b"\n",
            "an unknown anchor": text + b"seed: *nowhere\n",
            "a recursive alias": text + b"slicing: &x {a: *x}\n",
            "a document stream": text + b"---\n" + text,
        }
        for name, content in raw.items():
            yield Case(f"file: {name}", content, True, category="file")
        for index in range(40):  # cut anywhere: may still be a valid recipe, or one line
            cut = self.random.randrange(1, len(text))
            yield Case(f"file: cut at byte {cut} ({index})", text[:cut], False, category="file")

    def overrides(self) -> Iterator[Case]:
        """`--set` with malformed assignments, and every setting given a wrong value through it."""
        text = dump(self.base)
        bad = [
            "sparsity",
            "=0.3",
            "sparsity=[",
            "sparsity={a: 1",
            "pipeline.5.strategy=pca",
            "pipeline.x.strategy=pca",
            "sparsity.deep=1",
            "no_such_key=1",
            "sparsity=!!python/object/apply:os.system [ls]",
            f"sparsity={ANCHOR_TREE}",
            "seed=" + "9" * 5000,
            "sparsity=.inf",
            "sparsity=.nan",
            "a" * 300 + "=1",
        ]
        for assignment in bad:
            yield Case(f"set: {assignment[:60]}", text, True, overrides=(assignment,), category="set")
        for path, node, nullable, _ in self.schema.leaves():
            if path[0] == "pipeline" or _type(node) in ("object", None):
                continue
            for what, value, must_refuse in self._mutations(node, nullable):
                if not must_refuse or value is None or what.startswith("wrong type") and what != first_wrong(node):
                    continue  # one wrong type per setting: the reader of `--set` values is the file's
                literal = value if value is ANCHOR_TREE else yaml.safe_dump(value, default_flow_style=True).strip()
                literal = literal.removesuffix("\n...").strip()
                dotted = ".".join(path)
                parents = dump(_delete(_set(self.base, path, 0, self.fill), path))  # what the section needs
                yield Case(
                    f"set: {dotted} {what}",
                    parents,
                    True,
                    overrides=(f"{dotted}={literal}",),
                    category="set",
                    names=None if value is ANCHOR_TREE else path[-1],  # an alias tree is refused as YAML
                )

    def configs(self) -> Iterator[Case]:
        """The model's config.json: not an object, not JSON, a dimension that no model has."""
        text = dump(self.base)
        for name, value in {
            "a number": 3,
            "null": b"null",
            "a list": [1, 2],
            "a string": "llama",
            "not JSON": b"{model_type: llama",
            "not UTF-8": b'{"model_type": "ll\xe9ma"}',
            "empty": b"",
            "no model_type": {k: v for k, v in self.config.items() if k != "model_type"},
            "an unknown model_type": {**self.config, "model_type": "no-such-family"},
        }.items():
            yield Case(f"config: {name}", text, True, config=value, category="config")
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
            for what, value in {
                "negative": -256,
                "zero": 0,
                "a string": "six",
                "a float": 2.5,
                "null": None,
                "a list": [4],
                "huge": 10**6,
                "billions": 10**12,
            }.items():
                valid = what == "huge" and key != "num_hidden_layers"  # a million is a width some model may have
                yield Case(
                    f"config: {key} {what}", text, not valid, config={**self.config, key: value}, category="config"
                )

    def paths(self) -> Iterator[Case]:
        """Model, data and output paths that cannot be read or written."""
        long = "/tmp/" + "a" * 300
        for path in (("model", "path"), ("calibration", "dataset", "data_files"), ("output",)):
            for what, value in {
                "missing": "no/such/place",
                "longer than a name may be": long,
                "deeper than a path may be": "/tmp/" + "/".join(["b" * 200] * 30),
                "NUL in it": "bad\x00path",
                "the root": "/",
            }.items():
                must = not (path == ("output",) and what in ("the root", "missing"))  # a new folder is made
                yield self._case("path", f"{'.'.join(path)} {what}", _set(self.base, path, value, self.fill), must)
        yield self._case(
            "path", "output under a file", _set(self.base, ("output",), "/etc/hostname/out", self.fill), True
        )
        for section in ("calibration", "evaluation"):
            spec = {"path": "json"}
            yield self._case(
                "path", f"{section} json without files", _set(self.base, (section, "dataset"), spec, self.fill), True
            )
        yield self._case(
            "path", "model is a file", _set(self.base, ("model", "path"), "/etc/hostname", self.fill), True
        )


def shipped_recipes(folder: Path, model: Path, data: Path) -> list[dict[str, Any]]:
    """The project's recipes, read as a run reads them, moved onto the tiny `model` and the local
    `data` with few short windows, on this machine's CPU; each keeps its sections and options."""
    recipes = []
    local = {"path": "json", "data_files": str(data)}
    for file in sorted(folder.glob("*.yaml")):
        recipe = yaml.safe_load(file.read_text())
        recipe["model"] = {**recipe["model"], "path": str(model), "dtype": "float32"}
        recipe["model"].pop("load", None)
        for section in ("calibration", "evaluation"):
            if recipe.get(section):
                spec = recipe[section]
                spec.update(dataset=local, num_samples=4, seq_len=32, batch_size=2)
                for key in ("format", "messages_field"):
                    spec.pop(key, None)
        if recipe.get("evaluation"):
            recipe["evaluation"].pop("device_map", None)
            suites = recipe["evaluation"].get("lm_eval") or []
            for suite in suites if isinstance(suites, list) else [suites]:
                suite["tasks"] = [str(folder / t) if t.endswith(".yaml") else t for t in suite["tasks"]]
        if recipe.get("distillation"):
            recipe["distillation"]["dataset"] = local
        recipe.update(device="cpu", output="out")
        recipe.pop("activations", None)
        recipes.append(recipe)
    return recipes
