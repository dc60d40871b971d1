"""Plugin discovery with pluggy. Built-ins and third-party plugins load the same way:
through the `compressor` entry-point group of an installed distribution.

`COMPRESS_PLUGINS=name,name` loads only those entry points (installed code that is not named is
never imported); unset, every installed plugin loads. `compress strategies` shows what loaded.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Generic, TypeVar, cast

import pluggy

from compressor.errors import UserError, did_you_mean
from compressor.models.axes import AXES, Axis
from compressor.models.families import BUILTIN_FAMILIES, ModelFamily
from compressor.strategies.block_contract import BlockSelector
from compressor.strategies.contract import Strategy
from compressor.strategies.expert_contract import ExpertSelector
from compressor.strategies.head_contract import HeadSelector
from compressor.strategies.neuron_contract import NeuronSelector
from compressor.strategies.units import UnitSelector

PROJECT = "compressor"
ENTRY_POINT_GROUP = "compressor"
ALLOW_VARIABLE = "COMPRESS_PLUGINS"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class CompressorHookSpecs:
    """Hooks a plugin may implement."""

    @hookspec
    def compressor_strategies(self) -> list[Strategy]:
        """Return the selection strategies this plugin provides."""

    @hookspec
    def compressor_model_families(self) -> list[ModelFamily]:
        """Return descriptions of model families (by `model_type`) this plugin supports."""

    @hookspec
    def compressor_selectors(self) -> list[UnitSelector[Any]]:
        """Return the selectors of any axis this plugin provides (`UnitSelector`s; each one's `unit`
        says which axis's problems it takes)."""

    @hookspec
    def compressor_neuron_selectors(self) -> list[NeuronSelector]:
        """Return the MLP neuron selectors this plugin provides."""

    @hookspec
    def compressor_expert_selectors(self) -> list[ExpertSelector]:
        """Return the Mixture-of-Experts expert selectors this plugin provides."""

    @hookspec
    def compressor_block_selectors(self) -> list[BlockSelector]:
        """Return the depth selectors (which decoder blocks go) this plugin provides."""

    @hookspec
    def compressor_head_selectors(self) -> list[HeadSelector]:
        """Return the attention-head selectors (which query heads stay) this plugin provides."""

    @hookspec
    def compressor_axes(self) -> list[Axis]:
        """Return the axes this plugin prunes (`compressor.plugin.Axis`: its key, the recipe section its
        stage reads, which families allow it), which `compress families` and the dry run then list."""

    @hookspec
    def compressor_stages(self) -> list[Any]:
        """Return stages of a run this plugin adds (`compressor.plugin.Stage` subclasses' instances),
        each placed after the stage its `after` names."""


T = TypeVar("T")


@dataclass(frozen=True)
class Registered(Generic[T]):
    """One entry of any plugin kind (a strategy, a selector of any axis, a stage, a family): what it
    provides, the plugin that provided it, and the package (and version) that installed that."""

    item: T
    plugin: str
    source: str


@dataclass(frozen=True)
class Kind:
    """One kind of plugin entry: the hook that provides it and what a refusal calls it. A selector
    kind has its `unit`: the generic `compressor_selectors` hook's selectors of that unit join it."""

    hook: str
    name: str
    unit: str | None = None
    title: str = ""
    """The heading `compress strategies` lists a selector kind under."""


STRATEGY = Kind("compressor_strategies", "strategy")
NEURON_SELECTOR = Kind("compressor_neuron_selectors", "neuron selector", "neuron", "MLP neuron selectors")
EXPERT_SELECTOR = Kind("compressor_expert_selectors", "expert selector", "expert", "MoE expert selectors")
BLOCK_SELECTOR = Kind("compressor_block_selectors", "depth selector", "block", "depth selectors")
HEAD_SELECTOR = Kind("compressor_head_selectors", "head selector", "head", "attention-head selectors")
STAGE = Kind("compressor_stages", "stage")
SELECTOR_KINDS = (NEURON_SELECTOR, EXPERT_SELECTOR, BLOCK_SELECTOR, HEAD_SELECTOR)
"""The built-in axes' selector kinds, by unit; a plugin axis's unit gets a kind of its own."""
KINDS = (STRATEGY, *SELECTOR_KINDS, STAGE)
"""Every kind a plugin provides by name, collected the same way (families are by model_type)."""
GENERIC_SELECTORS = "compressor_selectors"


def selector_kind(unit: str) -> Kind:
    """The kind of the selectors of `unit`: a built-in axis's, or one for a plugin axis's unit."""
    for kind in SELECTOR_KINDS:
        if kind.unit == unit:
            return kind
    return Kind(GENERIC_SELECTORS, f"{unit} selector", unit, f"{unit} selectors")


@dataclass(frozen=True)
class InstalledPlugin:
    """One entry point of the `compressor` group and the package that installs it."""

    name: str
    entry: metadata.EntryPoint
    source: str
    """The package and its version, as `compress strategies` shows them."""


def scan_plugins() -> tuple[InstalledPlugin, ...]:
    """The installed entry points of the `compressor` group, in the order the packages are found.

    pluggy silently skips a second entry point of the same name; that is refused here instead.
    The scan reads every installed package's metadata (tens of milliseconds): it is remembered for
    the process's `sys.path` as its folders stand (a package installed or removed since changes a
    folder's time), so a process that builds many registries (a test suite) scans once."""
    return _scanned(tuple((folder, _modified(folder)) for folder in sys.path))


def _modified(folder: str) -> float:
    """When `folder`'s entries last changed (a package installed or removed there changes it)."""
    try:
        return os.stat(folder or ".").st_mtime
    except (OSError, ValueError):
        return 0.0


@functools.lru_cache(maxsize=8)
def _scanned(path: tuple[tuple[str, float], ...]) -> tuple[InstalledPlugin, ...]:
    owners: dict[str, str] = {}
    found = []
    for dist in metadata.distributions():
        for entry in dist.entry_points:
            if entry.group != ENTRY_POINT_GROUP:
                continue
            owner = dist.metadata["Name"]
            if owners.get(entry.name, owner) != owner:
                raise UserError(
                    f"plugin name '{entry.name}' is registered by two installed packages, "
                    f"'{owners[entry.name]}' and '{owner}'; uninstall one of them"
                )
            owners[entry.name] = owner
            found.append(InstalledPlugin(entry.name, entry, f"{owner} {dist.version}"))
    return tuple(found)


def allowed_plugins(installed: list[str]) -> list[str] | None:
    """The plugins `COMPRESS_PLUGINS` allows (None: unset, all); a name not installed is refused."""
    value = os.environ.get(ALLOW_VARIABLE)
    if value is None:
        return None
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in installed]
    if unknown:
        raise UserError(
            f"{ALLOW_VARIABLE} names '{unknown[0]}', which is not an installed plugin; installed: "
            f"{', '.join(installed) or 'none'}"
        )
    return names


class PluginRegistry:
    """All strategies provided by installed plugins (plus any registered directly)."""

    def __init__(self, extra_plugins: Iterable[object] = (), load_entry_points: bool = True) -> None:
        self.manager = pluggy.PluginManager(PROJECT)
        self.manager.add_hookspecs(CompressorHookSpecs)
        self.installed: list[str] = []
        self.allowed: list[str] | None = None
        """The plugins COMPRESS_PLUGINS allowed (None: all installed ones)."""
        self._sources: dict[str, str] = {}
        if load_entry_points:
            scanned = scan_plugins()
            self.installed = sorted({plugin.name for plugin in scanned})
            self.allowed = allowed_plugins(self.installed)
            order = scanned if self.allowed is None else [p for n in self.allowed for p in scanned if p.name == n]
            for plugin in order:  # as pluggy's load_setuptools_entrypoints would, from the one scan
                if self.manager.get_plugin(plugin.name) is None and not self.manager.is_blocked(plugin.name):
                    self.manager.register(plugin.entry.load(), name=plugin.name)
                    self._sources[plugin.name] = plugin.source
        for plugin in extra_plugins:
            self.manager.register(plugin)
        self._named = {kind: self._collect_named(kind, self._provided(kind.hook)) for kind in (STRATEGY, STAGE)}
        self._named.update(self._collect_selectors())
        self._families = self._collect_families()
        self._axes = self._collect_axes()

    def _source(self, name: str, plugin: object) -> str:
        """The package (and version) that installed plugin `name`; else the plugin object's name."""
        return self._sources.get(name) or getattr(plugin, "__name__", type(plugin).__name__)

    def _provided(self, hook: str) -> list[tuple[Any, Any]]:
        """(implementation, item) for everything each implementation of `hook` returns, in order."""
        return [
            (impl, item) for impl in getattr(self.manager.hook, hook).get_hookimpls() for item in impl.function() or []
        ]

    def _collect_named(self, kind: Kind, provided: Iterable[tuple[Any, Any]]) -> dict[str, Registered[Any]]:
        """The `provided` entries of `kind` by name; one name from two plugins is refused."""
        found: dict[str, Registered[Any]] = {}
        for impl, item in provided:
            if item.name in found:
                raise UserError(
                    f"{kind.name} '{item.name}' is provided twice, by plugins "
                    f"'{found[item.name].plugin}' and '{impl.plugin_name}'; uninstall one of them"
                )
            found[item.name] = Registered(item, impl.plugin_name, self._source(impl.plugin_name, impl.plugin))
        return found

    def _collect_selectors(self) -> dict[Kind, dict[str, Registered[Any]]]:
        """Every selector under its unit's kind: from its axis's own hook, or from the generic
        `compressor_selectors` by the `unit` it declares (a plugin axis's unit gets its kind)."""
        by_kind: dict[Kind, list[tuple[Any, Any]]] = {kind: [] for kind in SELECTOR_KINDS}
        for kind in SELECTOR_KINDS:
            for impl, item in self._provided(kind.hook):
                if getattr(item, "unit", kind.unit) != kind.unit:
                    raise UserError(
                        f"plugin '{impl.plugin_name}' returns {item.unit} selector '{item.name}' from {kind.hook}, "
                        f"which takes {kind.name}s; return it from {GENERIC_SELECTORS}"
                    )
                by_kind[kind].append((impl, item))
        for impl, item in self._provided(GENERIC_SELECTORS):
            if not isinstance(getattr(item, "unit", None), str):
                raise UserError(
                    f"plugin '{impl.plugin_name}' returns selector '{getattr(item, 'name', item)}' without a unit; "
                    "subclass one of compressor.plugin's selector classes (UnitSelector for a plugin axis)"
                )
            by_kind.setdefault(selector_kind(item.unit), []).append((impl, item))
        return {kind: self._collect_named(kind, provided) for kind, provided in by_kind.items()}

    def _collect_families(self) -> dict[str, Registered[ModelFamily]]:
        """Built-in families plus plugin ones, by model_type; a plugin's get its sliced classes."""
        found = {t: Registered(f, "built-in", "compressor") for f in BUILTIN_FAMILIES for t in f.model_types}
        for impl in self.manager.hook.compressor_model_families.get_hookimpls():
            for family in impl.function() or []:
                for model_type in family.model_types:
                    if model_type in found:
                        raise UserError(
                            f"model_type '{model_type}' is described twice, by '{found[model_type].plugin}' "
                            f"and plugin '{impl.plugin_name}'; uninstall one of them"
                        )
                    found[model_type] = Registered(
                        family, impl.plugin_name, self._source(impl.plugin_name, impl.plugin)
                    )
                from compressor.models.sliced import register_family  # the model stack, only for a plugin's family

                register_family(family)
        return found

    def _collect_axes(self) -> tuple[Axis, ...]:
        """The built-in axes, then the plugins'; one key twice is refused."""
        found: dict[str, str] = {axis.key: "built-in" for axis in AXES}
        axes = list(AXES)
        for impl, axis in self._provided("compressor_axes"):
            if axis.key in found:
                raise UserError(
                    f"axis '{axis.key}' is declared twice, by '{found[axis.key]}' and plugin '{impl.plugin_name}'; "
                    "rename the plugin's axis or uninstall one of them"
                )
            found[axis.key] = impl.plugin_name
            axes.append(axis)
        return tuple(axes)

    def axes(self) -> tuple[Axis, ...]:
        """Every axis a run can prune: the built-in ones (`models.axes.AXES`), then the plugins'."""
        return self._axes

    def skipped(self) -> list[str]:
        """Installed plugins that COMPRESS_PLUGINS kept from loading."""
        return [] if self.allowed is None else [name for name in self.installed if name not in self.allowed]

    def families(self) -> dict[str, Registered[ModelFamily]]:
        """Every supported model_type and the family that describes it."""
        return dict(sorted(self._families.items()))

    def entries(self, kind: Kind) -> dict[str, Registered[Any]]:
        """Every entry of `kind`, by name."""
        return dict(sorted(self._named.get(kind, {}).items()))

    def selector_kinds(self) -> list[Kind]:
        """The selector kinds: the built-in axes' units, then any plugin axis's unit that has selectors."""
        return [*SELECTOR_KINDS, *(kind for kind in self._named if kind.unit and kind not in SELECTOR_KINDS)]

    def unit_selectors(self, unit: str) -> dict[str, Registered[UnitSelector[Any]]]:
        """Every selector of `unit` (an axis's unit: "neuron", "head", "expert", "block", a plugin's), by name."""
        return self.entries(selector_kind(unit))

    def unit_selector(self, unit: str, name: str) -> UnitSelector[Any]:
        """The selector `name` of `unit`, or the line that refuses an unknown name."""
        kind = selector_kind(unit)
        return _named(self._named.get(kind, {}), name, kind.name).item

    def strategies(self) -> dict[str, Registered[Strategy]]:
        return self.entries(STRATEGY)

    def selectors(self) -> dict[str, Registered[NeuronSelector]]:
        """Every MLP neuron selector, by name."""
        return self.unit_selectors("neuron")

    def expert_selectors(self) -> dict[str, Registered[ExpertSelector]]:
        return self.unit_selectors("expert")

    def block_selectors(self) -> dict[str, Registered[BlockSelector]]:
        return self.unit_selectors("block")

    def head_selectors(self) -> dict[str, Registered[HeadSelector]]:
        return self.unit_selectors("head")

    def stages(self) -> list[Any]:
        """The stages plugins add to a run (`compressor.plugin.Stage`s), in the order the plugins registered them."""
        return [entry.item for entry in self._named[STAGE].values()]

    def selector(self, name: str) -> NeuronSelector:
        return cast(NeuronSelector, self.unit_selector("neuron", name))

    def expert_selector(self, name: str) -> ExpertSelector:
        return cast(ExpertSelector, self.unit_selector("expert", name))

    def block_selector(self, name: str) -> BlockSelector:
        return cast(BlockSelector, self.unit_selector("block", name))

    def head_selector(self, name: str) -> HeadSelector:
        return cast(HeadSelector, self.unit_selector("head", name))

    def strategy(self, name: str) -> Strategy:
        strategies = self._named[STRATEGY]
        if name not in strategies:
            known = ", ".join(sorted(strategies)) or "none (is compressor installed?)"
            restricted = (
                "" if self.allowed is None else f" ({ALLOW_VARIABLE}={','.join(self.allowed)} limits the plugins)"
            )
            raise UserError(
                f"unknown strategy '{name}'{did_you_mean(name, strategies)}; registered strategies: {known}{restricted}"
            )
        return strategies[name].item


def _named(table: Mapping[str, Any], name: str, kind: str) -> Any:
    """The registered entry `name` of one kind, or the line that refuses an unknown name."""
    if name not in table:
        known = ", ".join(sorted(table)) or "none (is compressor installed?)"
        raise UserError(f"unknown {kind} '{name}'{did_you_mean(name, table)}; registered {kind}s: {known}")
    return table[name]
