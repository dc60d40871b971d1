"""`mlp:` without `kept` (issue 34): the run measures every split of its budget between the
residual width and the MLP's width on held-out windows, keeps the best, and saves exactly the
model a run with that split fixed saves; the choice survives a kill; bad settings are one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from compressor.cli import main
from compressor.commands.compare import compare_runs
from compressor.errors import UserError
from compressor.evaluation.metrics import parameter_count
from compressor.plan.checks import plan
from compressor.recipe.schema import load_recipe
from compressor.stages.split_choice import choose
from compressor.strategies.registry import PluginRegistry
from tests.conftest import save_tiny_checkpoint
from tests.run.test_cli import _DELETE, write_recipe
from tests.run.test_resume import compress

SPLIT = {"heldout_windows": 2, "candidates": 3}
# threads fixed: runs compared tensor for tensor must not pick different counts (and float sums) under load
COMMON: dict[str, Any] = dict(
    sparsity=_DELETE, target_params=0.8, slicing={"layout": "global"}, evaluation=None, threads=2
)


@pytest.fixture(scope="module")
def wide_mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MLPs of 1024 neurons: at 80% of the parameters the budget has three splits (without, the
    embeddings of the tiny model are most of it and the MLP's width has nothing to give)."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("wide-mlp"), intermediate_size=1024)


def _report(folder: Path) -> dict:
    return json.loads((folder / "report.json").read_text())


def _model(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model" / "model.safetensors"))


def _untimed(split: dict) -> dict:
    """A split record without its candidates' prune times (the measurements, not the clock)."""
    return {**split, "candidates": [{k: v for k, v in c.items() if k != "prune_s"} for c in split["candidates"]]}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def _counted_walks_and_surveys(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """Lists that grow by one per walk (`prune_as_recipe`) and per survey pass of the original model."""
    from compressor.engine import survey as engine_survey
    from compressor.stages import walk

    walks: list[int] = []
    surveys: list[int] = []
    real_prune, real_survey = walk.prune_as_recipe, engine_survey.survey_pass
    monkeypatch.setattr(walk, "prune_as_recipe", lambda *args: walks.append(1) or real_prune(*args))
    monkeypatch.setattr(engine_survey, "survey_pass", lambda *args: surveys.append(1) or real_survey(*args))
    return walks, surveys


def _a_fixed_run_saves_the_same(folder: Path, checkpoint: Path, chosen: dict, **settings: Any) -> None:
    """A run with the chosen candidate's MLP width fixed (and `settings` as the choosing run's) saves
    the model the choosing run saved in `folder / "chosen"`, tensor for tensor."""
    fixed_mlp = {"kept": chosen["mlp_kept"]} if chosen["mlp_kept"] < 1024 else None
    recipe = write_recipe(folder / "b", checkpoint, output=str(folder / "fixed"), mlp=fixed_mlp, **settings, **COMMON)
    assert main(["run", str(recipe)]) == 0
    assert _same(_model(folder / "chosen"), _model(folder / "fixed"))


def test_the_run_keeps_the_split_with_the_lowest_heldout_kl_and_saves_what_a_fixed_run_saves(
    wide_mlp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without refinement the chosen split's trial is the run's own walk and MLP stage: three
    walks for three candidates, one survey of the original model for all of them, and the model a
    run with that split fixed (which surveys for itself) saves."""
    walks, surveys = _counted_walks_and_surveys(monkeypatch)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    recipe = write_recipe(tmp_path / "a", wide_mlp, output=str(tmp_path / "chosen"), mlp=SPLIT, **COMMON)
    assert main(["run", str(recipe)]) == 0
    assert len(walks) == 3  # one per candidate: the chosen one is not pruned again
    report = _report(tmp_path / "chosen")
    split = report["mlp"]["split"]
    candidates = split["candidates"]
    assert len(surveys) == split["survey_passes"] == 1  # recalled by the second and third walks
    assert all(c["prune_s"] > 0 for c in candidates)
    kls = [c["heldout_kl"] for c in candidates]
    assert len(candidates) == 3 and split["windows"] == 2
    assert candidates[0]["mlp_kept"] == report["mlp"]["of"] == 1024  # the residual width alone is a candidate
    assert split["chosen"] == kls.index(min(kls))
    chosen = candidates[split["chosen"]]
    assert report["kept_width"] == chosen["width"] and report["mlp"]["kept"] == chosen["mlp_kept"]
    assert report["params"]["pruned"] == chosen["params"] <= report["allocation"]["budget"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "chosen" / "model")
    assert model.config.hidden_size == chosen["width"] and model.config.intermediate_size == chosen["mlp_kept"]
    assert parameter_count(model) == chosen["params"]
    assert (tmp_path / "chosen" / "split.png").is_file()
    markdown = (tmp_path / "chosen" / "report.md").read_text()
    assert "(chosen)" in markdown and "| choosing the split (s) |" in markdown
    timings = report["timings"]
    assert timings["prune_s"] + timings.get("mlp_s", 0.0) < timings["split_s"]  # the chosen trial's, adopted
    # the run with that split fixed in its recipe saves the same model, tensor for tensor
    fixed_mlp = {"kept": chosen["mlp_kept"]} if chosen["mlp_kept"] < 1024 else None
    fixed = write_recipe(tmp_path / "b", wide_mlp, output=str(tmp_path / "fixed"), mlp=fixed_mlp, **COMMON)
    assert main(["run", str(fixed)]) == 0
    assert _report(tmp_path / "fixed")["kept_width"] == chosen["width"] and len(surveys) == 2
    assert _same(_model(tmp_path / "chosen"), _model(tmp_path / "fixed"))
    # compare names the neurons kept and the time choosing took, not just that mlp was set
    table = compare_runs([tmp_path / "chosen", tmp_path / "fixed"])[0]
    assert [row.get("MLP kept") for row in table] == [f"{chosen['mlp_kept']}/1024"] * 2
    assert table[0]["split s"] == timings["split_s"] and "split s" not in table[1]


def test_screened_splits_are_pruned_on_fewer_windows_and_the_chosen_one_on_every_window(
    wide_mlp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mlp.screen_windows`: each split's trial walks that many calibration windows with their own
    H; no trial is kept, so the run's walk then prunes the chosen split on every window, H and
    survey of its own, and saves what a run with that split fixed saves."""
    from compressor.engine import survey as engine_survey
    from compressor.stages import walk

    windows: list[int] = []
    surveys: list[int] = []
    real_prune, real_survey = walk.prune_as_recipe, engine_survey.survey_pass
    monkeypatch.setattr(
        walk,
        "prune_as_recipe",
        lambda *args: windows.append(sum(len(b.input_ids) for b in args[3])) or real_prune(*args),
    )
    monkeypatch.setattr(engine_survey, "survey_pass", lambda *args: surveys.append(1) or real_survey(*args))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    screened = {**SPLIT, "screen_windows": 2, "measure_best": None}  # every split measured
    sensitivity = [{"strategy": "sensitivity"}]  # H: the trials' on their windows, the run's on all
    recipe = write_recipe(
        tmp_path / "a", wide_mlp, output=str(tmp_path / "chosen"), mlp=screened, pipeline=sensitivity, **COMMON
    )
    assert main(["run", str(recipe)]) == 0
    assert windows == [2, 2, 2, 4] and len(surveys) == 2  # the trials share one; the run's own on all windows
    report = _report(tmp_path / "chosen")
    split = report["mlp"]["split"]
    assert split["screen_windows"] == 2 and report["fisher_source"] == "computed"
    assert "on 2 calibration windows" in (tmp_path / "chosen" / "report.md").read_text()
    chosen = split["candidates"][split["chosen"]]
    assert report["kept_width"] == chosen["width"] and report["mlp"]["kept"] == chosen["mlp_kept"]
    _a_fixed_run_saves_the_same(tmp_path, wide_mlp, chosen, pipeline=sensitivity)


@pytest.mark.parametrize("screen", [2, None])
def test_screened_trials_rank_splits_by_the_refit_and_the_saved_split_is_reconstructed(
    screen: int | None, wide_mlp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mlp.reconstruct` with the split open: screened trials are not trained (the chosen split is, by
    the run's own MLP stage, on every window); unscreened, every trial is trained, the chosen one is
    the saved model, and nothing trains after it. The saved model's layers carry their records."""
    import compressor.engine.neurons as neurons

    calls: list[int] = []
    real = neurons.reconstruct_mlp
    monkeypatch.setattr(neurons, "reconstruct_mlp", lambda *args: calls.append(len(args[0].inputs)) or real(*args))
    mlp = {**SPLIT, "screen_windows": screen, "measure_best": None, "reconstruct": {"steps": 4, "batch_tokens": 32}}
    recipe = write_recipe(tmp_path, wide_mlp, output=str(tmp_path / "out"), mlp=mlp, **COMMON)
    assert main(["run", str(recipe)]) == 0
    report = _report(tmp_path / "out")
    split, layers = report["mlp"]["split"], report["mlp"]["layers"]
    trained = [c for c in split["candidates"] if c["mlp_kept"] < 1024]  # the trials that prune the MLP
    chosen = split["candidates"][split["chosen"]]
    assert (
        chosen["mlp_kept"] < 1024 and len(trained) >= 2
    )  # the tiny model's choice, so the counts below mean something
    assert all(layer["reconstruction"] is not None for layer in layers)
    if screen is None:
        assert len(calls) == len(trained) * len(layers)
    else:
        assert len(calls) == len(layers) and set(calls) == {2}  # the run's own stage: both batches of 4 windows


def test_measure_best_prunes_only_the_best_predicted_splits_and_saves_what_a_fixed_run_saves(
    wide_mlp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mlp.measure_best`: every split's KL is predicted first (one survey, one H, both reused by
    the trials' walks), only the best predicted are pruned and measured, the lowest of those is
    kept, and the saved model is a fixed run's of that split, tensor for tensor."""
    walks, surveys = _counted_walks_and_surveys(monkeypatch)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    sensitivity = [{"strategy": "sensitivity"}]
    recipe = write_recipe(
        tmp_path / "a",
        wide_mlp,
        output=str(tmp_path / "chosen"),
        mlp={**SPLIT, "measure_best": 2},
        pipeline=sensitivity,
        **COMMON,
    )
    assert main(["run", str(recipe)]) == 0
    report = _report(tmp_path / "chosen")
    split = report["mlp"]["split"]
    candidates = split["candidates"]
    predicted = [c["predicted_kl"] for c in candidates]
    assert len(candidates) == 3 and all(kl >= 0 for kl in predicted) and split["measure_best"] == 2
    best_two = sorted(sorted(range(3), key=predicted.__getitem__)[:2])
    assert [i for i, c in enumerate(candidates) if c["heldout_kl"] is not None] == best_two
    assert len(walks) == 2 and len(surveys) == split["survey_passes"] == 1  # the prediction's survey, recalled
    assert report["fisher_source"] == "computed" and split["predict_s"] > 0
    assert split["chosen"] == min(best_two, key=lambda i: candidates[i]["heldout_kl"])
    markdown = (tmp_path / "chosen" / "report.md").read_text()
    assert "the 2 of 3 predicted best" in markdown and "not measured" in markdown
    chosen = candidates[split["chosen"]]
    _a_fixed_run_saves_the_same(tmp_path, wide_mlp, chosen, pipeline=sensitivity)


def test_a_pipeline_without_h_prunes_the_chosen_split_without_the_predictions_h(wide_mlp: Path, tmp_path: Path) -> None:
    """The prediction estimates H for itself; a pipeline that does without it (PCA) must not find it
    in the checkpoint afterwards: with refinement between the walk and the MLP stage the run prunes
    the chosen split again, and its MLP stage then chooses without H, as the trials and a fixed run do."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    refinement = {"epochs": 1}
    recipe = write_recipe(
        tmp_path / "a",
        wide_mlp,
        output=str(tmp_path / "chosen"),
        mlp={**SPLIT, "measure_best": 2},
        refinement=refinement,
        **COMMON,
    )
    assert main(["run", str(recipe)]) == 0
    report = _report(tmp_path / "chosen")
    chosen = report["mlp"]["split"]["candidates"][report["mlp"]["split"]["chosen"]]
    assert chosen["mlp_kept"] < 1024, "this test needs a split with the MLP pruned to win (it does, seeded)"
    assert report["mlp"]["weighed_by_h"] is False and report["fisher_source"] is None
    _a_fixed_run_saves_the_same(tmp_path, wide_mlp, chosen, refinement=refinement)


def test_when_the_residual_width_alone_measures_best_no_neuron_is_removed(
    wide_mlp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MLP stage does not run and the model keeps its MLPs whole (the measurement is replaced
    by one that favours the first candidate: which split wins on a random model is chance)."""
    from compressor.stages import split

    monkeypatch.setattr(split, "measured_split", lambda state, index, layout, original, rng: 1.0 + index)
    recipe = write_recipe(tmp_path, wide_mlp, mlp=SPLIT, **COMMON)
    assert main(["run", str(recipe)]) == 0
    report = _report(tmp_path / "out")
    assert report["mlp"]["split"]["chosen"] == 0 and report["mlp"]["kept"] == report["mlp"]["of"]
    assert report["mlp"]["layers"] == [] and "mlp_s" not in report["timings"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")
    assert model.config.intermediate_size == 1024 and model.config.hidden_size == report["kept_width"]


def test_choose_keeps_the_lowest_and_the_earlier_of_a_tie() -> None:
    from transformers import LlamaConfig

    from compressor.models.families import family_for
    from compressor.models.layout import LayoutRequest
    from compressor.models.split import split_layouts

    family = family_for("llama")
    config = LlamaConfig(
        hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, vocab_size=500
    )
    request = LayoutRequest(layout="global", target_params=0.7)
    splits = split_layouts(config, family, [family], request, min_kept=0.25, candidates=4)
    assert len(splits) >= 3
    record = choose(splits, lambda index, _: [0.3, 0.2, 0.2, 0.5][index], 7, lambda *_: None)
    assert record.chosen == 1 and record.windows == 7
    assert [c.width for c in record.candidates] == [s.kept for s in splits]
    assert record.candidates[0].mlp_kept == 256
    nan = float("nan")
    assert choose(splits, lambda index, _: [nan, 0.4, 0.3, nan][index], 7, lambda *_: None).chosen == 2
    with pytest.raises(UserError, match="no split of the budget gave a finite KL"):
        choose(splits, lambda *_: nan, 7, lambda *_: None)


@pytest.mark.parametrize(("kill", "refinement"), [("split:1", None), ("publish", None), ("mlp:0", {"epochs": 1})])
def test_a_run_killed_while_or_after_choosing_resumes_to_the_same_model(
    kill: str, refinement: dict | None, wide_mlp: Path, tmp_path: Path
) -> None:
    """Killed after the second split is measured (nothing kept: the choice starts again), after
    everything but publishing (the chosen trial was the run's walk; the resumed run walks that
    split itself), or, with refinement between the walk and the MLP stage, in the run's own MLP
    stage (the choice comes back from the checkpoint, not measured again): the model and the
    report's split are an uninterrupted run's."""
    recipe = write_recipe(
        tmp_path,
        wide_mlp,
        pipeline=[{"strategy": "sensitivity"}],
        mlp={**SPLIT, "candidates": 2},
        refinement=refinement,
        **COMMON,
    )
    whole = compress(recipe, tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    report = _report(tmp_path / "whole")
    assert report["mlp"]["kept"] < 1024, "this test needs a split with the MLP pruned to win (it does, seeded)"
    assert report["fisher_source"] == "computed" and not report["resume"]["fisher_loaded"]
    killed = compress(recipe, tmp_path / "run", kill=kill)
    assert killed.returncode == -9, killed.stderr
    resumed = compress(recipe, tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr
    assert ("split 1/2" in resumed.stderr + resumed.stdout) == (kill == "split:1")  # measured again only then
    resumed_report = _report(tmp_path / "run")
    assert resumed_report["fisher_source"] != "computed"  # H was not computed again
    if kill != "mlp:0":  # there every site is saved: the resumed walk needs no H
        assert resumed_report["fisher_source"] == "checkpoint" and resumed_report["resume"]["fisher_loaded"]
    assert _untimed(resumed_report["mlp"]["split"]) == _untimed(_report(tmp_path / "whole")["mlp"]["split"])
    assert _same(_model(tmp_path / "whole"), _model(tmp_path / "run"))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mlp": {"kept": 0.5, "candidates": 3}}, "mlp.candidates applies when the plan chooses the split"),
        ({"mlp": {}, "allocation": {"method": "curves"}, "slicing": {}}, "fix mlp.kept, or remove allocation"),
        ({"mlp": {"heldout_windows": 10**6}}, "mlp.heldout_windows: 1000000 windows after the 4 calibration windows"),
        ({"mlp": {"candidates": 1}}, "mlp.candidates"),
        ({"mlp": {"screen_windows": 4}}, "mlp.screen_windows 4 is not fewer than the 4 calibration windows"),
        ({"mlp": {"kept": 0.5, "screen_windows": 2}}, "mlp.screen_windows applies when the plan chooses the split"),
        ({"mlp": {"measure_best": 5}}, "mlp.measure_best 5 is more than the 4 candidate splits"),
        ({"mlp": {"kept": 0.5, "measure_best": 2}}, "mlp.measure_best applies when the plan chooses the split"),
        ({"mlp": {"measure_best": 2}, "slicing": {}}, "set slicing.layout: global, or remove mlp.measure_best"),
    ],
)
def test_bad_split_settings_are_one_line_and_write_nothing(
    changes: dict, message: str, wide_mlp: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    recipe = write_recipe(tmp_path, wide_mlp, **{**COMMON, **changes})
    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_dry_run_lists_the_splits(wide_mlp: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    recipe = write_recipe(tmp_path, wide_mlp, mlp=SPLIT, **COMMON)
    assert main(["run", str(recipe), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "splits of the budget" in out and "with MLP whole" in out and "each pruned on" not in out
    screened = write_recipe(tmp_path, wide_mlp, mlp={**SPLIT, "screen_windows": 2}, **COMMON)
    assert main(["run", str(screened), "--dry-run"]) == 0
    assert "each pruned on 2 calibration windows (the chosen one on all)" in capsys.readouterr().out.replace("\n", " ")
    predicted = write_recipe(tmp_path, wide_mlp, mlp={**SPLIT, "measure_best": 2}, **COMMON)
    assert main(["run", str(predicted), "--dry-run"]) == 0
    assert "predicts 3 splits and measures the 2 best" in capsys.readouterr().out.replace("\n", " ")
    assert not (tmp_path / "out").exists()


def test_a_budget_with_no_split_but_the_residual_width_alone_says_so_and_measures_nothing(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The tiny model's embeddings are most of it: at 70% no wider stream leaves its MLPs a quarter
    of their 128 neurons, so there is nothing to choose."""
    recipe = write_recipe(tmp_path, tiny_checkpoint, mlp=SPLIT, **{**COMMON, "target_params": 0.7})
    assert main(["run", str(recipe)]) == 0
    captured = capsys.readouterr()
    assert "warning: mlp: the budget leaves no wider residual stream" in captured.out + captured.err
    assert "choosing the split" not in captured.err + captured.out
    report = _report(tmp_path / "out")
    assert report["mlp"]["kept"] == report["mlp"]["of"] == 128 and "split" not in report["mlp"]
    assert "split_s" not in report["timings"]


SENSITIVITY = [{"strategy": "sensitivity"}]


LONG = {"calibration__seq_len": 128}  # the tiny model's positions: 64 windows make the fewest tokens a screen takes


@pytest.mark.parametrize(
    ("changes", "decided"),
    [
        ({}, (None, None)),  # PCA estimates no H to predict with; 4 windows are too few to screen
        ({"pipeline": SENSITIVITY}, (2, None)),
        ({"pipeline": SENSITIVITY, "calibration__num_samples": 256, **LONG}, (2, 64)),
        ({"pipeline": SENSITIVITY, "calibration__num_samples": 256}, (2, None)),  # 64 windows of 64 tokens: too few
        ({"calibration__num_samples": 252, **LONG}, (None, None)),  # a quarter is 63 windows, 8,064 tokens
        ({"pipeline": SENSITIVITY, "calibration__num_samples": 512, **LONG}, (2, 128)),
        ({"pipeline": SENSITIVITY, "calibration__num_samples": 512, **LONG, "mlp__measure_best": None}, (None, 128)),
        ({"pipeline": SENSITIVITY, "calibration__num_samples": 512, **LONG, "mlp__screen_windows": None}, (2, None)),
        ({"pipeline": SENSITIVITY, "mlp__candidates": 2}, (None, None)),  # 2 splits: predicting saves nothing
        ({"mlp__measure_best": 3, "mlp__screen_windows": 3}, (3, 3)),  # as given, H or not
        ({"pipeline": SENSITIVITY, "calibration__num_samples": 512, **LONG, "slicing": {}}, (None, None)),  # per site
    ],
)
def test_auto_choice_settings_are_decided_by_the_plan(
    changes: dict, decided: tuple, wide_mlp: Path, tmp_path: Path
) -> None:
    """`mlp.measure_best` and `mlp.screen_windows` default to `auto`: the plan measures the 2 predicted
    best where a sensitivity pipeline estimates H and there are more than 2 splits, and screens on a
    quarter of the calibration windows where that is 16 or more; a number or null is taken as given."""
    registry = PluginRegistry()
    path = write_recipe(tmp_path, wide_mlp, mlp={**SPLIT}, **{**COMMON, **changes})
    checked = plan(load_recipe(path, registry), registry)
    assert len(checked.splits) == changes.get("mlp__candidates", 3)
    assert (checked.measure_best, checked.screen_windows) == decided


def test_auto_screens_on_at_least_four_tokens_per_neuron_and_not_where_kept_fixes_the_mlp(tmp_path: Path) -> None:
    """MLPs of 4,096 neurons: a screen needs 16,384 tokens, so 256 windows of 128 (a quarter: 8,192) are
    pruned whole and 512 are screened on 128. With `mlp.kept` the MLP is not chosen: auto is null there
    (and an explicit null is not refused), while `heads: {}` still chooses its counts."""
    registry = PluginRegistry()
    wide = save_tiny_checkpoint(tmp_path / "wide", intermediate_size=4096)
    decided = {}
    for windows in (256, 512):
        path = write_recipe(
            tmp_path, wide, mlp={**SPLIT}, pipeline=SENSITIVITY, calibration__num_samples=windows, **LONG, **COMMON
        )
        decided[windows] = plan(load_recipe(path, registry), registry).screen_windows
    assert decided == {256: None, 512: 128}
    for kept in ({"kept": 0.5}, {"kept": 0.5, "measure_best": None, "screen_windows": None}):
        path = write_recipe(
            tmp_path, wide, mlp=kept, heads={}, pipeline=SENSITIVITY, calibration__num_samples=512, **LONG, **COMMON
        )
        checked = plan(load_recipe(path, registry), registry)
        assert checked.chooses_split and (checked.measure_best, checked.screen_windows) == (None, None)


def test_auto_choice_settings_stay_off_where_they_were_not_measured(tmp_path: Path) -> None:
    """Routed experts: neither the prediction (expert widths) nor screening (routing on fewer tokens)
    was measured there, so `auto` is null; the explicit settings are refused as before."""
    registry = PluginRegistry()
    checkpoint = save_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", mlp_only_layers=[])
    choose = {"heldout_windows": 2}
    path = write_recipe(
        tmp_path,
        checkpoint,
        experts=choose,
        mlp={**choose, "candidates": 2},
        pipeline=SENSITIVITY,
        calibration__num_samples=64,
        **COMMON,
    )
    checked = plan(load_recipe(path, registry), registry)
    assert len(checked.splits) > 2 and checked.layout.active is not None
    assert (checked.measure_best, checked.screen_windows) == (None, None)
