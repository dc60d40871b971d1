"""The memory plan: its phases follow the recipe's settings, its measured H pass without
recomputation extrapolates exactly, and a run or dry run whose peak is above the machine's
memory is refused in one line before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from compressor.cli import main
from compressor.models.families import family_for
from compressor.models.layout import LayoutRequest, sliced_layout
from compressor.plan.fake_layer import FakeBatch, fisher_peak
from compressor.plan.memory import Machine, MemoryPlan, PlanSettings, memory_plan
from compressor.stages.costs import GiB, Phase
from tests.conftest import COMMON, FAMILY_CONFIGS, tiny_model
from tests.run.test_cli import write_recipe


def _layout(name: str = "llama", **overrides):
    config = AutoConfig.for_model(**{**COMMON, **FAMILY_CONFIGS[name], **overrides})
    family = family_for(config.model_type)
    return sliced_layout(config, family, [family], LayoutRequest(sparsity=0.25))


def _phases(plan: MemoryPlan) -> dict[str, Phase]:
    return {phase.name.split(" (")[0]: phase for phase in plan.phases}


def test_the_plan_counts_what_the_settings_keep_in_host_memory() -> None:
    layout = _layout()
    d = layout.config.hidden_size
    base = PlanSettings(dtype="float32", samples=16, seq_len=32, batch=4, mlp_feedback=0.5)
    host = _phases(memory_plan(base, layout, needs_h=True, accelerator=True))
    stream = 16 * 32 * d * 4
    disk = _phases(memory_plan(PlanSettings(**{**base.__dict__, "activations": "disk"}), layout, True, True))
    for name in ("capture", "H pass", "walk"):
        assert host[name].host - disk[name].host == stream
    assert host["mlp"].host - disk["mlp"].host == 2 * stream  # the feedback's reference copy
    plain = _phases(memory_plan(PlanSettings(**{**base.__dict__, "mlp_feedback": 0.0}), layout, True, True))
    assert host["mlp"].host - plain["mlp"].host == stream
    without_h = _phases(memory_plan(base, layout, needs_h=False, accelerator=True))
    assert "H pass" not in without_h and host["walk"].host - without_h["walk"].host == (2 * 2 + 1) * d * d * 4
    # on CPU the device is the host: a layer-wise phase adds its device bytes, a whole-model one does not
    cpu = _phases(memory_plan(base, layout, needs_h=True, accelerator=False))
    assert cpu["walk"].device is None and cpu["walk"].host == host["walk"].host + (host["walk"].device or 0)
    assert cpu["evaluation"].host == host["evaluation"].host


def test_the_h_pass_without_recomputation_grows_linearly_with_depth() -> None:
    """The plan measures one and two layers and extrapolates; a direct fake measurement of four
    layers gives the same bytes."""
    config = AutoConfig.for_model(**{**COMMON, **FAMILY_CONFIGS["llama"]})
    family = family_for("llama")
    shape = FakeBatch(torch.float32, 2, 16, "sdpa")
    peaks = [fisher_peak(config, family, shape, False, depth) for depth in (1, 2, 4)]
    assert peaks[1] > peaks[0]
    assert peaks[2] == peaks[0] + 3 * (peaks[1] - peaks[0])
    assert fisher_peak(config, family, shape, True, 4) < peaks[2]  # one layer at a time


def test_the_refusal_names_the_phase_that_does_not_fit_and_what_to_change() -> None:
    layout = _layout()
    plan = memory_plan(PlanSettings(dtype="float32", samples=16, seq_len=32, batch=4), layout, True, True)
    peak = plan.peak_host()
    assert plan.refusal(Machine(peak.host, None, "cpu")) is None
    line = plan.refusal(Machine(peak.host - 1, None, "cpu"))
    assert line is not None and peak.name in line and peak.fix in line and "\n" not in line
    device = plan.peak_device()
    assert device is not None and device.device is not None
    line = plan.refusal(Machine(10 * GiB, device.device - 1, "a small GPU"))
    assert line is not None and "a small GPU" in line and device.name in line and device.fix in line


def test_a_run_that_cannot_fit_stops_before_writing_anything(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, output=str(tmp_path / "out"))
    monkeypatch.setenv("COMPRESS_HOST_MEMORY_GIB", "0.001")
    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "of host memory at its peak" in err and "this machine has 1.0 MiB" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]  # no output, no staging folder

    assert main(["run", str(recipe), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out.startswith("recipe checked, but the run would stop here") and "memory plan for llama" in out
    assert "host memory" in err and err.count("\n") == 1

    assert main(["run", str(recipe), "--dry-run", "--skip-memory-check"]) == 0
    assert "warning: this run needs about" in capsys.readouterr().out
    assert main(["run", str(recipe), "--skip-memory-check"]) == 0
    assert (tmp_path / "out" / "report.json").is_file()


def test_a_dry_run_prints_every_phase_of_the_plan(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, pipeline=[{"strategy": "sensitivity"}], mlp={"kept": 32})
    assert main(["run", str(recipe), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for phase in ("capture", "H pass", "walk", "mlp", "evaluation"):
        assert f"note:   {phase}" in out
    assert "checked: memory: the peak" in out


def test_a_streamed_plan_holds_only_what_lies_outside_the_layers_while_passes_read_them() -> None:
    layout = _layout()
    base = PlanSettings(dtype="float32", samples=16, seq_len=32, batch=4)
    memory = _phases(memory_plan(base, layout, needs_h=True, accelerator=True))
    stream = _phases(memory_plan(PlanSettings(**{**base.__dict__, "load": "stream"}), layout, True, True))
    model = tiny_model("llama")
    layers = model.get_submodule(family_for("llama").layers)
    layer_bytes = sum(p.numel() * 4 for p in layers.parameters())
    for name in ("capture", "H pass"):
        assert memory[name].host - stream[name].host == layer_bytes
    assert stream["evaluation"].host == memory["evaluation"].host  # lm-eval tasks or throughput: the original whole
    layerwise = PlanSettings(**{**base.__dict__, "load": "stream", "evaluation_layerwise": (4, 32, 2)})
    by_layer = _phases(memory_plan(layerwise, layout, True, True))["evaluation"]
    assert by_layer.name.startswith("evaluation (layer by layer")
    assert by_layer.host < memory["evaluation"].host  # not both models whole
    assert "model.load: stream" in memory["capture"].fix and "model.load: stream" not in stream["capture"].fix


def test_a_written_walk_holds_one_layer_one_h_and_two_bases_and_its_weights_need_not_fit() -> None:
    layout = _layout()
    d, kept = layout.config.hidden_size, layout.kept
    base = PlanSettings(dtype="float32", samples=16, seq_len=32, batch=4, load="stream")
    kept_layers = _phases(memory_plan(base, layout, True, True))
    written_plan = memory_plan(PlanSettings(**{**base.__dict__, "writes": True}), layout, True, True)
    written = _phases(written_plan)
    assert written["walk"].name.startswith("walk (one layer at a time, each written")
    model = tiny_model("llama")
    layer_bytes = sum(p.numel() * 4 for p in model.get_submodule(family_for("llama").layers)[0].parameters())
    sites, h_bytes, basis_bytes = 2 * layout.config.num_hidden_layers + 1, d * d * 4, d * kept * 8
    pruned = layout.params.count(layout.widths) * 4
    # kept: the sliced layers (the pruned model less what lies outside the layers), every H and basis;
    # written: the layer on the host (read there before it goes to the device), one H, two bases
    outside = written_plan.weights - layout.config.num_hidden_layers * layer_bytes
    assert kept_layers["walk"].host - written["walk"].host == (
        min(written_plan.weights, outside + pruned)
        - outside
        - layer_bytes
        + (sites - 1) * h_bytes
        + (sites - 2) * basis_bytes
    )
    assert kept_layers["capture"].host == written["capture"].host  # the passes before the walk do not change
    # a streamed walk that keeps its layers is told what would write them as it goes
    assert "writes each sliced layer as it goes" in kept_layers["walk"].fix
    assert "writes each sliced layer" not in written["walk"].fix
    machine = Machine(host=int(written_plan.weights * 0.9), device=None, device_name="cpu")
    refusal = memory_plan(PlanSettings(**{**base.__dict__, "writes": True, "samples": 4096}), layout, True, True)
    line = refusal.refusal(machine)
    assert line is not None and "the weights alone do not fit" not in line  # streamed: they never need to


def test_auto_streams_only_where_the_whole_model_does_not_fit(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from compressor.plan import memory
    from compressor.plan.checks import plan
    from compressor.recipe.schema import load_recipe
    from compressor.strategies.registry import PluginRegistry

    monkeypatch.setattr(memory, "process_rss", lambda: 0)  # the same base for every plan
    registry = PluginRegistry()
    path = write_recipe(tmp_path, tiny_checkpoint, evaluation=None, model__load="auto")
    recipe = load_recipe(path, registry, [], None)
    checked, cpu = plan(recipe, registry), torch.device("cpu")
    peaks = {}
    for load in ("memory", "stream"):
        fixed = load_recipe(path, registry, [f"model.load={load}"], None)
        peaks[load] = memory.run_memory_plan(fixed, checked, cpu).peak_host().host
    assert peaks["stream"] < peaks["memory"]
    chosen, line = memory.resolved_load(recipe, checked, cpu, Machine(peaks["memory"], None, "cpu"))
    assert chosen.model.load == "memory" and line is not None and "chose memory" in line
    chosen, line = memory.resolved_load(recipe, checked, cpu, Machine(peaks["memory"] - 1, None, "cpu"))
    assert chosen.model.load == "stream" and line is not None and "chose stream" in line
    fixed = load_recipe(path, registry, ["model.load=memory"], None)
    assert memory.resolved_load(fixed, checked, cpu, Machine(1, None, "cpu")) == (fixed, None)


@pytest.mark.parametrize(
    ("changes", "writes"),
    [
        ({"evaluation": None}, True),
        ({"evaluation__throughput": True}, False),  # both models whole for throughput: the walk keeps its layers
        ({"evaluation": None, "refinement": {}}, False),
    ],
)
def test_the_plan_writes_as_it_goes_where_the_run_does(
    tiny_checkpoint: Path, tmp_path: Path, changes: dict, writes: bool
) -> None:
    from compressor.plan import memory
    from compressor.plan.checks import plan
    from compressor.recipe.schema import load_recipe
    from compressor.strategies.registry import PluginRegistry

    registry = PluginRegistry()
    recipe = load_recipe(write_recipe(tmp_path, tiny_checkpoint, model__load="stream", **changes), registry, [], None)
    checked, cpu = plan(recipe, registry), torch.device("cpu")
    for save_model in (True, False):  # a sweep's runs save no model by default: they keep the layers
        walk = _phases(memory.run_memory_plan(recipe, checked, cpu, save_model))["walk"]
        assert ("each written" in walk.name) == (writes and save_model)
        assert memory.writes_as_it_goes(recipe, checked.layout, save_model) == (writes and save_model)


@pytest.mark.parametrize("load", ["stream", "memory"])
def test_lm_eval_on_placed_models_is_planned_as_a_note_and_the_rest_layer_by_layer(
    tiny_checkpoint: Path, tmp_path: Path, load: str
) -> None:
    from compressor.plan import memory
    from compressor.plan.checks import plan
    from compressor.recipe.schema import load_recipe
    from compressor.strategies.registry import PluginRegistry
    from tests.evaluation.test_lm_eval import _write_task

    _write_task(tmp_path / "tasks")
    registry = PluginRegistry()
    suite = {"tasks": ["tasks/tiny_choice.yaml"]}
    placed_path = write_recipe(
        tmp_path, tiny_checkpoint, model__load=load, evaluation__lm_eval=suite, evaluation__device_map="auto"
    )
    placed = load_recipe(placed_path, registry, [], None)
    whole = load_recipe(placed_path, registry, ["evaluation.device_map=null"], None)
    checked, cpu = plan(placed, registry), torch.device("cpu")
    plans = {name: memory.run_memory_plan(r, checked, cpu) for name, r in (("placed", placed), ("whole", whole))}
    evaluation = {name: _phases(p)["evaluation"] for name, p in plans.items()}
    assert evaluation["placed"].name.startswith("evaluation (layer by layer")
    assert evaluation["whole"].name == "evaluation (both models on the device)"
    assert any("placed by accelerate" in note for note in plans["placed"].notes) and not plans["whole"].notes
    assert plans["placed"].notes[-1] in plans["placed"].lines()
    # the walk writes as it goes where it streams: lm-eval reads the written model/ from disk
    assert ("each written" in _phases(plans["placed"])["walk"].name) == (load == "stream")
    assert "each written" not in _phases(plans["whole"])["walk"].name
    if load == "memory":  # the original whole on the host; on CPU the pruned model counted once
        on_gpu = _phases(memory.run_memory_plan(placed, checked, torch.device("cuda")))["evaluation"]
        assert evaluation["placed"].host - plans["placed"].base > plans["placed"].weights
        assert on_gpu.device is not None and on_gpu.device > 0
        assert evaluation["placed"].host < on_gpu.host + on_gpu.device


@pytest.mark.parametrize(
    ("tie_head", "tied_fit", "writes"),
    [(False, "symmetric", True), (True, "diagonal", True), (True, "symmetric", False)],
)
def test_a_global_walk_writes_as_it_goes_unless_its_tied_head_rotates_every_layer_after_it(
    tiny_checkpoint: Path, tmp_path: Path, tie_head: bool, tied_fit: str, writes: bool
) -> None:
    from types import SimpleNamespace

    from compressor.plan import memory
    from compressor.recipe.schema import load_recipe
    from compressor.strategies.registry import PluginRegistry

    path = write_recipe(
        tmp_path,
        tiny_checkpoint,
        model__load="stream",
        evaluation=None,
        slicing={"layout": "global", "tied_fit": tied_fit},
    )
    recipe = load_recipe(path, PluginRegistry(), [], None)
    layout = SimpleNamespace(one_basis=True, tie_head=tie_head)
    assert memory.writes_as_it_goes(recipe, layout) is writes
    assert memory.writes_as_it_goes(recipe, SimpleNamespace(one_basis=False, tie_head=tie_head))  # per site


def test_a_global_walk_counts_its_pools_on_the_device_and_the_head_s_moment_on_the_host() -> None:
    from compressor.models.layout import LayoutRequest, sliced_layout
    from compressor.plan.fake_layer import measure_device

    config = AutoConfig.for_model(**{**COMMON, **FAMILY_CONFIGS["llama"]})
    family = family_for("llama")
    d = config.hidden_size
    settings = PlanSettings(dtype="float32", samples=16, seq_len=32, batch=4)
    for layout, extra in (
        (sliced_layout(config, family, [family], LayoutRequest(sparsity=0.25)), 0),
        (sliced_layout(config, family, [family], LayoutRequest(sparsity=0.25, layout="global")), 2 * d * d * 8),
    ):
        walk = _phases(memory_plan(settings, layout, True, True))["walk"]
        measured = measure_device(config, family, FakeBatch(torch.float32, 4, 32, "sdpa"), layout.kept, True)
        assert walk.device == measured["walk"] + extra


def test_whole_model_evaluation_counts_a_batch_of_vocabulary_wide_log_probabilities(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """Evaluating both models holds a batch's log-probabilities of each and the KL's temporaries,
    vocabulary-wide (Gemma 3 270M at 8 windows of 256 tokens: 10 GiB beside 2 GiB of weights):
    the plan's figure grows with the batch by what `compare` is measured to hold."""
    from compressor.evaluation.memtrack import LiveBytes
    from compressor.evaluation.metrics import compare
    from compressor.plan import memory
    from compressor.plan.checks import plan
    from compressor.recipe.schema import load_recipe
    from compressor.strategies.registry import PluginRegistry
    from tests.conftest import random_batches

    registry = PluginRegistry()
    recipe = load_recipe(write_recipe(tmp_path, tiny_checkpoint, evaluation__batch_size=2), registry, [], None)
    checked, cpu = plan(recipe, registry), torch.device("cpu")
    figures = {}
    for batch in (2, 4):
        changed = load_recipe(tmp_path / "recipe.yaml", registry, [f"evaluation.batch_size={batch}"], None)
        planned = memory.run_memory_plan(changed, checked, cpu)
        figures[batch] = _phases(planned)["evaluation"].host - planned.base  # base: this process, measured
    vocab, tokens = checked.layout.config.vocab_size, recipe.evaluation.seq_len
    assert figures[4] - figures[2] == 5 * 2 * tokens * vocab * 4
    model = tiny_model("llama", vocab_size=vocab)
    with LiveBytes() as live:  # the models' weights existed before: only what evaluation allocates
        compare(model, model, random_batches(vocab, count=2, batch=4, length=tokens), cpu)
    assert 4 * tokens * vocab * 4 * 4 < live.peak["cpu"] <= 5 * 4 * tokens * vocab * 4 * 1.05
