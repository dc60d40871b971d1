"""`depth:` in a recipe (issue 49, item 2): whole decoder blocks removed before the walk, chosen
on the original model, and saved so that the family's own class reloads the model without them;
with nothing else pruned that is exactly the original without those blocks. The measured selector
removes the block whose own removal costs least on the held-out windows; the budget is still the
original's; bad settings are refused in one line; a run killed mid-walk resumes to the same model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from compressor.cli import main
from compressor.evaluation.metrics import compare, parameter_count
from compressor.models.depth import remove_blocks
from compressor.models.families import family_for
from compressor.plan.checks import plan
from compressor.recipe.schema import load_recipe
from compressor.run.runner import RunOptions, run
from compressor.runtime.loading import heldout_batches
from compressor.strategies.block_contract import BlockProblem, BlockSelector
from compressor.strategies.registry import PluginRegistry, hookimpl
from compressor.strategies.units import UnitChoice
from tests.conftest import max_relative_logit_error, random_batches, save_tiny_checkpoint
from tests.run.test_cli import _DELETE, write_recipe

SLIDING = dict(
    layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
    use_sliding_window=True,
    sliding_window=8,
)
"""A Qwen3 whose blocks alternate full and sliding-window attention: the saved `layer_types` must
follow the kept blocks, or the reload attends differently."""


def _report(folder: Path) -> dict:
    return json.loads((folder / "report.json").read_text())


@pytest.fixture(scope="module")
def four_blocks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("llama4"), "llama", num_hidden_layers=4)


@pytest.mark.parametrize(
    ("name", "layout", "overrides"),
    [("llama", "global", {}), ("llama", "per_site", {}), ("qwen3", "global", SLIDING)],
)
def test_blocks_removed_with_nothing_else_pruned_are_exactly_the_model_without_them(
    name: str, layout: str, overrides: dict, tmp_path: Path
) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / name, name, num_hidden_layers=4, **overrides)
    recipe = write_recipe(
        tmp_path, checkpoint, sparsity=0.0, slicing={"layout": layout}, depth={"removed": 2, "selector": "influence"}
    )
    assert main(["run", str(recipe)]) == 0
    report = _report(tmp_path / "out")
    depth = report["depth"]
    assert depth["of"] == 4 and len(depth["removed"]) == 2 and depth["selector"] == "influence"
    influence = depth["influence"]
    assert sorted(sorted(range(4), key=lambda i: (influence[i], i))[:2]) == depth["removed"]
    assert report["model"]["num_layers"] == 4
    saved = AutoModelForCausalLM.from_pretrained(
        tmp_path / "out" / "model", dtype=torch.float32, trust_remote_code=layout == "per_site"
    )
    assert saved.config.num_hidden_layers == 2
    expected = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    remove_blocks(expected, family_for(expected.config.model_type), depth["removed"])
    if layout == "global":
        assert type(saved) is type(expected)
        assert getattr(saved.config, "layer_types", None) == getattr(expected.config, "layer_types", None)
    if overrides:  # the kept blocks' own kinds
        assert saved.config.layer_types == [SLIDING["layer_types"][i] for i in range(4) if i not in depth["removed"]]
    batches = random_batches(saved.config.vocab_size, length=32)
    assert max_relative_logit_error(expected, saved, batches) < 1e-5
    assert parameter_count(saved) == report["params"]["pruned"]


def test_the_measured_selector_removes_the_block_whose_removal_costs_least_on_the_heldout_windows(
    four_blocks: Path, tmp_path: Path
) -> None:
    recipe_path = write_recipe(tmp_path, four_blocks, sparsity=0.0, depth={"removed": 1, "heldout_windows": 2})
    assert main(["run", str(recipe_path)]) == 0
    depth = _report(tmp_path / "out")["depth"]
    assert depth["selector"] == "kl" and depth["measurements"] == 4 and depth["heldout_windows"] == 2 * 1
    recipe = load_recipe(recipe_path, PluginRegistry())
    windows = heldout_batches(recipe.calibration, AutoTokenizer.from_pretrained(four_blocks), 2, "depth")
    original = AutoModelForCausalLM.from_pretrained(four_blocks, dtype=torch.float32)
    kls = []
    for block in range(4):  # each removal measured by the test, on a model without the block
        without = AutoModelForCausalLM.from_pretrained(four_blocks, dtype=torch.float32)
        remove_blocks(without, family_for("llama"), [block])
        kls.append(compare(original, without, windows, torch.device("cpu"))["pruned"]["kl"])
    assert depth["removed"] == [min(range(4), key=lambda i: kls[i])]
    assert depth["heldout_kl"] == pytest.approx(min(kls), rel=1e-4)
    assert depth["objectives"]["kl_after_each"] == [depth["heldout_kl"]]
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert f"| decoder blocks | 4 | 3 (removed {depth['removed'][0]}; kl) |" in markdown


@pytest.mark.parametrize("budget", [{"sparsity": _DELETE, "target_params": 0.75}, {"sparsity": 0.25}])
def test_the_budget_is_the_original_s_and_the_width_takes_what_the_blocks_leave(
    budget: dict, four_blocks: Path, tmp_path: Path
) -> None:
    """At `target_params: 0.75` (or SliceGPT's model at `sparsity: 0.25`, of the original) a run
    without one block keeps a wider stream than one with all four, within the same budget, and the
    plan's count is the saved model's."""
    kept = {}
    for removed in (None, 1):
        folder = tmp_path / f"removed-{removed}"
        folder.mkdir()
        changes = {} if removed is None else {"depth": {"removed": removed, "selector": "influence"}}
        recipe = write_recipe(folder, four_blocks, evaluation=None, slicing={"round_to": 1}, **budget, **changes)
        assert main(["run", str(recipe)]) == 0
        report = _report(folder / "out")
        assert report["params"]["pruned"] == report["allocation"]["predicted_params"] <= report["allocation"]["budget"]
        kept[removed] = (report["kept_width"], report["allocation"]["budget"])
    assert kept[1][1] == kept[None][1]  # one budget: a share of the original's parameters
    assert kept[1][0] > kept[None][0]


class SecondBlock(BlockSelector):
    name = "second-block"
    description = "removes block 1 (a third party's selector, naming the blocks that stay)"

    def select(self, problem: BlockProblem) -> UnitChoice:
        return UnitChoice([block for block in range(problem.blocks) if block != 1])


class ThirdParty:
    @hookimpl
    def compressor_selectors(self) -> list[BlockSelector]:
        return [SecondBlock()]


def test_a_third_party_selector_s_blocks_go_and_the_plan_made_again_may_choose_a_split(tmp_path: Path) -> None:
    """A Qwen3-MoE whose blocks 0 and 1 are dense, its MoE blocks larger: the plan counts the last
    block (MoE) as removed, which leaves the stream whole at this budget, so one split; the selector
    removes block 1 (dense, smaller), and the plan made again has several, which the run measures
    on held-out windows read for them."""
    checkpoint = save_tiny_checkpoint(
        tmp_path / "moe", "qwen3_moe", num_hidden_layers=4, mlp_only_layers=[0, 1], moe_intermediate_size=64
    )
    registry = PluginRegistry(extra_plugins=[ThirdParty()])
    path = write_recipe(
        tmp_path,
        checkpoint,
        sparsity=_DELETE,
        target_params=0.97,
        evaluation=None,
        slicing={"round_to": 1},
        mlp={"heldout_windows": 2, "round_to": 1},
        depth={"removed": 1, "selector": "second-block"},
    )
    recipe = load_recipe(path, registry)
    assert len(plan(recipe, registry).splits) == 1
    report = run(recipe, registry)
    assert report is not None and report.depth is not None and report.depth.removed == [1]
    assert report.mlp is not None and report.mlp.split is not None and len(report.mlp.split.candidates) > 1
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model", trust_remote_code=True)
    assert saved.config.num_hidden_layers == 3 and saved.config.mlp_only_layers == [0]  # block 1's entry gone
    assert parameter_count(saved) == report.params.pruned <= report.allocation.budget


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"depth": {"removed": 4}}, "depth.removed 4 removes every one of the model's 4 blocks; remove at most 3"),
        ({"depth": {"removed": 1, "selector": "infuence"}}, "unknown depth selector 'infuence' (did you mean"),
        (
            {"depth": {"removed": 1, "selector": "influence", "shortlist": 2}},
            "depth.shortlist applies to a selector that measures (kl)",
        ),
        ({"depth": {"removed": 1}, "model__load": "stream"}, "depth: a streamed model reads its layers"),
        ({"depth": {"removed": 1}, "refinement": {}}, "depth: refinement rebuilds the pruned model"),
    ],
)
def test_bad_depth_settings_are_one_line_and_write_nothing(
    changes: dict, message: str, four_blocks: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    recipe = write_recipe(tmp_path, four_blocks, **changes)
    capsys.readouterr()
    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_depth_where_the_stream_is_kept_whole_or_under_torchrun_is_refused_in_one_line(
    four_blocks: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    gemma = save_tiny_checkpoint(tmp_path / "gemma", "gemma3_text")
    recipe = write_recipe(
        tmp_path, gemma, sparsity=_DELETE, target_params=0.9, slicing={"layout": "global"}, mlp={}, depth={"removed": 1}
    )
    capsys.readouterr()
    assert main(["run", str(recipe), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "depth: a global gemma3_text keeps its stream whole" in err and err.count("\n") == 1
    recipe = write_recipe(tmp_path, four_blocks, depth={"removed": 1})
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["run", str(recipe), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "depth runs in one process" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_run_killed_mid_walk_resumes_without_the_same_blocks_to_a_bit_identical_model(
    four_blocks: Path, tmp_path: Path
) -> None:
    """SIGKILL after the first layer's attention: the resumed run reads the blocks it chose from the
    checkpoint (not chosen again), the walked sites with them, and saves what an uninterrupted run saves."""
    from tests.run.test_resume import killed_and_resumed_is_whole

    recipe = write_recipe(
        tmp_path,
        four_blocks,
        evaluation=None,
        pipeline=[{"strategy": "sensitivity"}],
        depth={"removed": 2, "heldout_windows": 2},
    )
    killed_and_resumed_is_whole(recipe, tmp_path, "site:layers.0.attn", sites=2)
    assert _report(tmp_path / "run")["depth"] == _report(tmp_path / "whole")["depth"]


def test_depth_keeps_the_model_in_memory_and_saved(four_blocks: Path, tmp_path: Path) -> None:
    """`model.load: auto` never streams a run that removes blocks, even where only streaming would
    fit, and a run that keeps only its bases (a sweep's `save_models: false`) is refused: the bases
    cannot rebuild the model without its blocks."""
    from compressor.errors import UserError
    from compressor.plan.memory import Machine, resolved_load

    registry = PluginRegistry()
    recipe = load_recipe(write_recipe(tmp_path, four_blocks, model__load="auto", depth={"removed": 1}), registry)
    checked = plan(recipe, registry)
    tiny = Machine(host=1, device=None, device_name="cpu")  # nothing fits in memory here
    resolved, line = resolved_load(recipe, checked, torch.device("cpu"), tiny)
    assert resolved.model.load == "memory" and line is not None and "depth removes blocks" in line
    with pytest.raises(UserError, match="depth: a run that removes blocks saves its model"):
        run(recipe, registry, options=RunOptions(save_model=False))
    assert not (tmp_path / "out").exists()


def _with_a_silent_block(folder: Path, block: int = 2) -> Path:
    """A 4-block Llama whose block `block` writes nothing to the stream (its attention's and MLP's output
    projections zero): removing it costs nothing, so the budget's parameters it frees buy width for free."""
    checkpoint = save_tiny_checkpoint(folder, "llama", num_hidden_layers=4, intermediate_size=1024)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    layer = model.model.layers[block]
    layer.self_attn.o_proj.weight.data.zero_()
    layer.mlp.down_proj.weight.data.zero_()
    model.save_pretrained(checkpoint)
    return checkpoint


OPEN = dict(
    sparsity=_DELETE,
    target_params=0.8,
    evaluation=None,
    slicing={"layout": "global"},
    pipeline=[{"strategy": "sensitivity"}],
)


def test_depth_without_removed_is_a_candidate_of_the_split_and_the_chosen_blocks_save_as_a_fixed_run(
    tmp_path: Path,
) -> None:
    """`depth: {}`: the candidates are every block kept and one block removed (a quarter of 4), each with
    the MLP's splits; the silent block is the selector's and the lowest held-out KL's, and the run saves
    what a run with that block count and split fixed saves, tensor for tensor. Depth alone keeps the
    split's record in the depth section, in report.json and report.md."""
    from safetensors.torch import load_file

    checkpoint = _with_a_silent_block(tmp_path / "llama")
    (tmp_path / "a").mkdir()
    mlp = {"heldout_windows": 2, "candidates": 2, "measure_best": None}  # every candidate measured
    depth = {"heldout_windows": 2}
    path = write_recipe(tmp_path / "a", checkpoint, output=str(tmp_path / "chosen"), mlp=mlp, depth=depth, **OPEN)
    assert main(["run", str(path)]) == 0
    report = _report(tmp_path / "chosen")
    split, depth_record = report["mlp"]["split"], report["depth"]
    candidates = split["candidates"]
    assert [c["removed_blocks"] for c in candidates] == [None, None, [2], [2]]
    assert depth_record["candidates"][0]["removed"] == [2] and depth_record["candidates"][0]["heldout_kl"] < 1e-9
    kls = [c["heldout_kl"] for c in candidates]
    chosen = candidates[split["chosen"]]
    assert split["chosen"] == kls.index(min(kls)) and chosen["removed_blocks"] == [2]  # width for free wins
    assert depth_record["removed"] == [2] and depth_record["heldout_kl"] < 1e-9
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "chosen" / "model")
    assert saved.config.num_hidden_layers == 3 and report["model"]["num_layers"] == 4
    assert parameter_count(saved) == report["params"]["pruned"] <= report["allocation"]["budget"]
    (tmp_path / "b").mkdir()
    fixed_mlp = None if chosen["mlp_kept"] == 1024 else {"kept": chosen["mlp_kept"]}
    fixed = write_recipe(
        tmp_path / "b",
        checkpoint,
        output=str(tmp_path / "fixed"),
        mlp=fixed_mlp,
        depth={"removed": 1, "heldout_windows": 2},
        **OPEN,
    )
    assert main(["run", str(fixed)]) == 0
    assert _report(tmp_path / "fixed")["depth"]["removed"] == [2]
    ours, theirs = (load_file(str(tmp_path / r / "model" / "model.safetensors")) for r in ("chosen", "fixed"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # depth alone: the record goes with the depth section
    (tmp_path / "c").mkdir()
    alone = write_recipe(tmp_path / "c", checkpoint, output=str(tmp_path / "alone"), depth=depth, **OPEN)
    assert main(["run", str(alone)]) == 0
    depth_record = _report(tmp_path / "alone")["depth"]
    assert [c["removed_blocks"] for c in depth_record["split"]["candidates"]] == [None, [2]]
    markdown = (tmp_path / "alone" / "report.md").read_text()
    assert "split: width" in markdown and "without block 2 (chosen)" in markdown
    assert "candidate: without 2" in markdown


def test_open_depth_counts_are_predicted_with_the_removal_measured_alone(tmp_path: Path) -> None:
    """With `mlp.measure_best` and the influence selector (which measures nothing itself), the depth
    stage measures each count's blocks alone on its windows, and a candidate without them is predicted
    that KL plus the width terms of the blocks it keeps: never below the removal alone, and only the
    best predicted are measured."""
    checkpoint = _with_a_silent_block(tmp_path / "llama", block=1)
    path = write_recipe(
        tmp_path,
        checkpoint,
        mlp={"heldout_windows": 2, "candidates": 2, "measure_best": 2},
        depth={"selector": "influence", "heldout_windows": 2, "max_removed": 2, "candidates": 3},
        **OPEN,
    )
    assert main(["run", str(path)]) == 0
    report = _report(tmp_path / "out")
    depth, candidates = report["depth"], report["mlp"]["split"]["candidates"]
    removed = [c["removed_blocks"] for c in candidates]
    counts = [len(blocks or []) for blocks in removed]
    assert counts == sorted(counts) and set(counts) == {0, 1, 2}  # none, then 1 and 2 blocks, each with its splits
    alone = {tuple(c["removed"]): c["heldout_kl"] for c in depth["candidates"]}
    assert len(alone) == 2 and all(kl is not None for kl in alone.values()) and depth["measurements"] == 2
    for candidate in candidates:
        if candidate["removed_blocks"]:
            assert candidate["predicted_kl"] >= alone[tuple(candidate["removed_blocks"])] - 1e-12
    assert sum(c["heldout_kl"] is not None for c in candidates) == 2


@pytest.mark.parametrize("screen", [None, 2])
def test_a_run_killed_after_choosing_blocks_with_the_split_resumes_without_them_to_the_same_model(
    screen: int | None, tmp_path: Path
) -> None:
    """SIGKILL once the split choice (which chose a block) is checkpointed: the resumed run takes the
    same blocks from the model it loads whole, estimates H of the model without them (the trials' H,
    of the model with every block, is not reused) and saves the uninterrupted run's model, which
    kept its chosen trial (every window) or pruned the chosen split again (`screen_windows`)."""
    from safetensors.torch import load_file

    from tests.run.test_resume import compress

    checkpoint = _with_a_silent_block(tmp_path / "llama")
    recipe = write_recipe(
        tmp_path,
        checkpoint,
        mlp={"heldout_windows": 2, "candidates": 2, "measure_best": None, "screen_windows": screen},
        depth={"heldout_windows": 2},
        **OPEN,
    )
    whole = compress(recipe, tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    killed = compress(recipe, tmp_path / "run", kill="stage:choosing the split of the budget")
    assert killed.returncode == -9, killed.stderr
    resumed = compress(recipe, tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr
    report, expected = _report(tmp_path / "run"), _report(tmp_path / "whole")
    assert report["depth"] == expected["depth"] and report["depth"]["removed"] == [2]
    assert report["fisher_source"] == "computed"
    ours, theirs = (load_file(str(tmp_path / r / "model" / "model.safetensors")) for r in ("whole", "run"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize(
    ("depth", "message"),
    [
        (
            {"removed": 1, "max_removed": 2},
            "depth.max_removed applies when the run chooses the block count, but "
            "depth.removed fixes it; remove one of them",
        ),
        ({"removed": 1, "candidates": 3}, "depth.candidates applies when the run chooses the block count"),
        ({"max_removed": 4}, "depth.max_removed 4 removes every one of the model's 4 blocks; remove at most 3"),
        ({"selector": "influence", "shortlist": 2}, "depth.shortlist applies to a selector that measures (kl)"),
    ],
)
def test_bad_open_depth_settings_are_one_line_and_write_nothing(
    depth: dict, message: str, four_blocks: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    recipe = write_recipe(tmp_path, four_blocks, depth=depth)
    capsys.readouterr()
    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
