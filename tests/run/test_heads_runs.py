"""`heads:` in a recipe (issue 49, item 1): every attention layer keeps as many query heads per KV
group, chosen after the walk, the output projection refitted; with nothing else pruned and no
refit that is exactly the original with the dropped heads silenced, saved as the family's own
class with fewer heads and an explicit `head_dim`. The budget counts the heads; a third party's
selector chooses; bad settings are refused in one line; a run killed in the stage resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from compressor.cli import main
from compressor.evaluation.metrics import parameter_count
from compressor.plan.checks import plan
from compressor.recipe.schema import load_recipe
from compressor.run.runner import run
from compressor.strategies.head_contract import HeadChoice, HeadProblem, HeadSelector
from compressor.strategies.registry import PluginRegistry, hookimpl
from tests.conftest import max_relative_logit_error, random_batches, save_tiny_checkpoint
from tests.run.test_cli import _DELETE, write_recipe


def _report(folder: Path) -> dict:
    return json.loads((folder / "report.json").read_text())


def _silenced(checkpoint: Path, kept: list[list[int]]) -> AutoModelForCausalLM:
    """The original with every head not in its layer's `kept` writing nothing."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    width = model.config.head_dim
    for layer, heads in zip(model.model.layers, kept, strict=True):
        for head in range(model.config.num_attention_heads):
            if head not in heads:
                layer.self_attn.o_proj.weight.data[:, head * width : (head + 1) * width] = 0
    return model


@pytest.mark.parametrize("layout", ["global", "per_site"])
def test_heads_removed_with_nothing_else_pruned_are_exactly_the_model_without_them(layout: str, tmp_path: Path) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / "llama", "llama", num_attention_heads=8, num_key_value_heads=2)
    recipe = write_recipe(
        tmp_path,
        checkpoint,
        sparsity=0.0,
        slicing={"layout": layout},
        heads={"kept": 0.5, "selector": "norm", "refit": False},
    )
    assert main(["run", str(recipe)]) == 0
    report = _report(tmp_path / "out")
    heads = report["heads"]
    assert (heads["kept"], heads["of"], heads["head_dim"], heads["selector"]) == (4, 8, 16, "norm")
    kept = [layer["kept"] for layer in heads["layers"]]
    assert all(len(k) == 4 and sum(h < 4 for h in k) == 2 for k in kept)  # two per KV group
    saved = AutoModelForCausalLM.from_pretrained(
        tmp_path / "out" / "model", dtype=torch.float32, trust_remote_code=layout == "per_site"
    )
    assert saved.config.num_attention_heads == 4 and saved.config.head_dim == 16
    assert saved.config.num_key_value_heads == 2
    expected = _silenced(checkpoint, kept)
    if layout == "global":
        assert type(saved) is type(expected)
    assert max_relative_logit_error(expected, saved, random_batches(saved.config.vocab_size, length=32)) < 1e-5
    assert parameter_count(saved) == report["params"]["pruned"]
    assert "query heads per layer" in (tmp_path / "out" / "report.md").read_text()


def test_the_budget_counts_the_heads_and_the_width_takes_what_they_leave(tmp_path: Path) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / "llama", "llama", num_attention_heads=8, num_key_value_heads=2)
    registry = PluginRegistry()
    widths = {}
    for heads in (None, {"kept": 4}):
        recipe = load_recipe(
            write_recipe(
                tmp_path, checkpoint, sparsity=_DELETE, target_params=0.8, slicing={"round_to": 1}, heads=heads
            ),
            registry,
        )
        layout = plan(recipe, registry).layout
        assert layout.counted.count(layout.widths) <= layout.budget
        widths[heads is None] = layout.kept
    assert widths[False] > widths[True]  # four heads fewer per layer buy residual width


class Last(HeadSelector):
    """A third party's selector: the last heads of every group."""

    name = "last-heads"

    def select(self, problem: HeadProblem) -> HeadChoice:
        size = problem.heads // problem.groups
        return HeadChoice([g * size + size - 1 - i for g in range(problem.groups) for i in range(problem.per_group)])


class ThirdParty:
    @hookimpl
    def compressor_head_selectors(self) -> list[HeadSelector]:
        return [Last()]


def test_a_third_party_selector_s_heads_stay_beside_a_chosen_mlp_split(tmp_path: Path) -> None:
    """With `mlp: {}` every split measured prunes the heads too, and the chosen trial's heads are the run's."""
    checkpoint = save_tiny_checkpoint(tmp_path / "llama", "llama", num_attention_heads=8, num_key_value_heads=2)
    registry = PluginRegistry(extra_plugins=[ThirdParty()])
    path = write_recipe(
        tmp_path,
        checkpoint,
        sparsity=_DELETE,
        target_params=0.85,
        evaluation=None,
        slicing={"round_to": 1},
        mlp={"heldout_windows": 2, "candidates": 2, "round_to": 1},
        heads={"kept": 2, "selector": "last-heads"},
    )
    report = run(load_recipe(path, registry), registry)
    assert report is not None and report.heads is not None and report.mlp is not None
    assert report.mlp.split is not None and len(report.mlp.split.candidates) == 2
    assert [layer.kept for layer in report.heads.layers] == [[3, 7], [3, 7]]
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model", trust_remote_code=True)
    assert saved.config.num_attention_heads == 2
    assert parameter_count(saved) == report.params.pruned <= report.allocation.budget


def test_heads_without_kept_are_chosen_with_the_split_and_predicted_where_asked(tmp_path: Path) -> None:
    """`heads: {}`: the run's candidates are every head count (every head first) with each MLP split;
    it keeps the lowest held-out KL and saves what a run with that count and split fixed saves,
    tensor for tensor. With `mlp.measure_best` the head counts are predicted too."""
    from safetensors.torch import load_file

    checkpoint = save_tiny_checkpoint(
        tmp_path / "llama", "llama", num_attention_heads=8, num_key_value_heads=2, intermediate_size=1024
    )
    common = dict(
        sparsity=_DELETE,
        target_params=0.8,
        evaluation=None,
        slicing={"layout": "global"},
        pipeline=[{"strategy": "sensitivity"}],
    )
    mlp = {"heldout_windows": 2, "candidates": 2, "measure_best": None}  # every candidate measured
    (tmp_path / "a").mkdir()
    path = write_recipe(tmp_path / "a", checkpoint, output=str(tmp_path / "chosen"), mlp=mlp, heads={}, **common)
    assert main(["run", str(path)]) == 0
    report = _report(tmp_path / "chosen")
    split = report["mlp"]["split"]
    candidates = split["candidates"]
    assert [c["heads"] for c in candidates] == [None, None, 4, 4]  # every head, then half: each with 2 splits
    assert candidates[0]["mlp_kept"] == 1024 and all(c["heldout_kl"] is not None for c in candidates)
    kls = [c["heldout_kl"] for c in candidates]
    chosen = candidates[split["chosen"]]
    assert split["chosen"] == kls.index(min(kls))
    assert report["heads"]["kept"] == (chosen["heads"] or 8) and report["heads"]["of"] == 8
    assert report["heads"].get("split") is None  # the mlp section holds the record
    fixed_heads = None if chosen["heads"] is None else {"kept": chosen["heads"]}
    fixed_mlp = None if chosen["mlp_kept"] == 1024 else {"kept": chosen["mlp_kept"]}
    (tmp_path / "b").mkdir()
    fixed = write_recipe(
        tmp_path / "b", checkpoint, output=str(tmp_path / "fixed"), mlp=fixed_mlp, heads=fixed_heads, **common
    )
    assert main(["run", str(fixed)]) == 0
    ours = load_file(str(tmp_path / "chosen" / "model" / "model.safetensors"))
    theirs = load_file(str(tmp_path / "fixed" / "model" / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    (tmp_path / "c").mkdir()
    predicted = write_recipe(
        tmp_path / "c",
        checkpoint,
        output=str(tmp_path / "predicted"),
        mlp={**mlp, "measure_best": 2},
        heads={},
        **common,
    )
    assert main(["run", str(predicted)]) == 0
    candidates = _report(tmp_path / "predicted")["mlp"]["split"]["candidates"]
    assert [c["heads"] for c in candidates] == [None, None, 4, 4]
    predictions = [c["predicted_kl"] for c in candidates]
    assert candidates[2]["width"] == candidates[0]["width"] and candidates[2]["mlp_kept"] == 1024
    assert predictions[2] > predictions[0]  # the same widths with half the heads: more loss predicted
    assert sum(c["heldout_kl"] is not None for c in candidates) == 2
    # heads alone: the record goes with the heads, in report.json and report.md
    (tmp_path / "d").mkdir()
    alone = write_recipe(tmp_path / "d", checkpoint, output=str(tmp_path / "alone"), heads={}, **common)
    assert main(["run", str(alone)]) == 0
    heads = _report(tmp_path / "alone")["heads"]
    assert [c["heads"] for c in heads["split"]["candidates"]] == [None, 4]
    assert heads["kept"] == (heads["split"]["candidates"][heads["split"]["chosen"]]["heads"] or 8)
    assert "(chosen)" in (tmp_path / "alone" / "report.md").read_text()


def test_a_run_killed_while_choosing_predicted_head_counts_resumes_to_the_same_model(tmp_path: Path) -> None:
    """SIGKILL after the first measured candidate of a choice over head counts and splits with
    `mlp.measure_best`: the resumed run predicts and measures again (H from the checkpoint) and
    saves the uninterrupted run's model and split record."""
    from safetensors.torch import load_file

    from tests.run.test_mlp_split import _untimed
    from tests.run.test_resume import compress

    checkpoint = save_tiny_checkpoint(
        tmp_path / "llama", "llama", num_attention_heads=8, num_key_value_heads=2, intermediate_size=1024
    )
    recipe = write_recipe(
        tmp_path,
        checkpoint,
        sparsity=_DELETE,
        target_params=0.8,
        evaluation=None,
        slicing={"layout": "global"},
        pipeline=[{"strategy": "sensitivity"}],
        mlp={"heldout_windows": 2, "candidates": 2, "measure_best": 2},
        heads={},
    )
    whole = compress(recipe, tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    split = _report(tmp_path / "whole")["mlp"]["split"]
    first = next(i for i, c in enumerate(split["candidates"]) if c["heldout_kl"] is not None)
    killed = compress(recipe, tmp_path / "run", kill=f"split:{first}")
    assert killed.returncode == -9, killed.stderr
    resumed = compress(recipe, tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr
    report = _report(tmp_path / "run")
    assert report["fisher_source"] == "checkpoint"  # H was not computed again
    assert _untimed(report["mlp"]["split"]) == _untimed(split) | {"predict_s": report["mlp"]["split"]["predict_s"]}
    ours, theirs = (load_file(str(tmp_path / r / "model" / "model.safetensors")) for r in ("whole", "run"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        ("llama", {"heads": {"kept": 3}}, "heads.kept 3: every one of the 2 KV groups keeps the same number"),
        ("llama", {"heads": {"kept": 2.5}}, "heads.kept 2.5: give a whole number of heads"),
        ("llama", {"heads": {"kept": 2, "selector": "nrom"}}, "unknown head selector 'nrom' (did you mean"),
        ("olmo2", {"heads": {"kept": 2}}, "heads: olmo2 models cannot hold fewer query heads"),
        ("phi3", {"heads": {"kept": 2}}, "computes queries in one linear"),
        ("llama", {"heads": {"kept": 2, "candidates": 3}}, "heads.candidates applies when the run chooses"),
        ("olmo2", {"heads": {}}, "heads: olmo2 models cannot hold fewer query heads"),
        ("opt", {"heads": {"kept": 2}}, "does not read head_dim from the config"),
        ("opt", {"heads": {}}, "does not read head_dim from the config"),
    ],
)
def test_bad_heads_settings_are_one_line_and_write_nothing(
    name: str, changes: dict, message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / name, name)
    recipe = write_recipe(tmp_path, checkpoint, **changes)
    capsys.readouterr()
    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_run_killed_in_the_heads_stage_resumes_to_a_bit_identical_model(tmp_path: Path) -> None:
    """SIGKILL after the first attention layer's heads: the walk's sites come from the checkpoint and
    the stage runs again to the same heads and weights."""
    from tests.run.test_resume import killed_and_resumed_is_whole

    checkpoint = save_tiny_checkpoint(tmp_path / "llama", "llama")
    recipe = write_recipe(
        tmp_path, checkpoint, evaluation=None, pipeline=[{"strategy": "sensitivity"}], heads={"kept": 2}
    )
    killed_and_resumed_is_whole(recipe, tmp_path, "heads:0", sites=5)
    heads = _report(tmp_path / "run")["heads"]
    assert heads == _report(tmp_path / "whole")["heads"] and heads["weighed_by_h"]


def test_a_stock_layout_s_width_steps_by_the_heads_the_saved_class_has(tmp_path: Path) -> None:
    """LlamaConfig wants hidden_size a multiple of num_attention_heads: with 2 of 8 heads kept the
    saved class asks a multiple of 2, not of the original's 8, so the budget buys a finer width."""
    checkpoint = save_tiny_checkpoint(tmp_path / "llama", "llama", num_attention_heads=8, num_key_value_heads=2)
    registry = PluginRegistry()
    multiples = {}
    for heads in (None, {"kept": 2}):
        path = write_recipe(
            tmp_path, checkpoint, sparsity=_DELETE, target_params=0.8, slicing={"layout": "global"}, heads=heads
        )
        layout = plan(load_recipe(path, registry), registry).layout
        assert layout.rounding is not None
        multiples[heads is None] = layout.rounding["class_multiple"]
    assert multiples == {True: 8, False: 2}
