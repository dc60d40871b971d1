"""`slicing.kept` (issue 49: a recipe can fix or forbid any axis): the residual width fixed, the
MLP's neurons taking what `target_params` leaves; at the hidden size the stream is kept whole.
One split, nothing measured, the model a run with those neurons fixed saves; bad settings are one
line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from compressor.cli import main
from compressor.evaluation.metrics import parameter_count
from compressor.plan.checks import plan
from compressor.recipe.schema import load_recipe
from compressor.strategies.registry import PluginRegistry
from tests.conftest import save_tiny_checkpoint
from tests.run.test_cli import _DELETE, write_recipe

COMMON: dict[str, Any] = dict(sparsity=_DELETE, target_params=0.8, evaluation=None)
GLOBAL = {"layout": "global"}


@pytest.fixture(scope="module")
def wide_mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stream of 128 and MLPs of 1024 neurons: at 80% of the parameters the budget has splits from
    96 to 128 wide, with widths between them."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("wide-mlp"), hidden_size=128, intermediate_size=1024)


def _plan(tmp_path: Path, checkpoint: Path, **changes: Any) -> Any:
    registry = PluginRegistry()
    return plan(load_recipe(write_recipe(tmp_path, checkpoint, **{**COMMON, **changes}), registry), registry)


def test_a_fixed_width_is_the_one_split_the_chooser_would_have_offered_at_it(wide_mlp: Path, tmp_path: Path) -> None:
    """Each candidate of the open split, asked for by its width, comes back as the only split with
    the same MLP width and parameters; the residual width alone is the layout without the MLP."""
    chooser = _plan(tmp_path, wide_mlp, slicing=GLOBAL, mlp={"candidates": 3})
    assert len(chooser.splits) == 3
    for candidate in chooser.splits:
        fixed = _plan(tmp_path, wide_mlp, slicing={**GLOBAL, "kept": candidate.kept}, mlp={})
        assert len(fixed.splits) == 1 and not fixed.chooses_split
        (layout,) = fixed.splits
        assert (layout.kept, layout.mlp_width) == (candidate.kept, candidate.mlp_width)
        assert layout.counted.count(layout.widths) == candidate.counted.count(candidate.widths) <= layout.budget


def test_a_width_between_candidates_spends_the_budget_on_the_mlp(wide_mlp: Path, tmp_path: Path) -> None:
    """A width no candidate has: the MLP keeps the most neurons (multiples of `mlp.round_to`) that
    fit, so one more step of them would narrow the stream."""
    chooser = _plan(tmp_path, wide_mlp, slicing=GLOBAL, mlp={"candidates": 3})
    low, high = chooser.splits[1].kept, chooser.splits[2].kept
    width = next(w for w in range(low + 8, high, 8) if w not in {s.kept for s in chooser.splits})
    (layout,) = _plan(tmp_path, wide_mlp, slicing={**GLOBAL, "kept": width}, mlp={}).splits
    assert layout.kept == width and layout.widths == layout.uniform(width)
    assert layout.counted.count(layout.widths) <= layout.budget
    one_more = _plan(tmp_path, wide_mlp, slicing=GLOBAL, mlp={"kept": layout.mlp_width + 8}).layout
    assert one_more.kept is not None and one_more.kept < width  # a step (mlp.round_to) more: the stream narrows


def test_the_stream_kept_whole_saves_what_a_run_with_those_neurons_fixed_saves(wide_mlp: Path, tmp_path: Path) -> None:
    """`slicing.kept` at the hidden size: the stock model keeps its width, its MLPs give the whole cut,
    no split is measured, and the tensors are those of a run with `mlp.kept` at the same neurons."""
    hidden = AutoModelForCausalLM.from_pretrained(wide_mlp).config.hidden_size
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole = write_recipe(
        tmp_path / "a", wide_mlp, output=str(tmp_path / "whole"), slicing={**GLOBAL, "kept": hidden}, mlp={}, **COMMON
    )
    assert main(["run", str(whole)]) == 0
    report = json.loads((tmp_path / "whole" / "report.json").read_text())
    kept = report["mlp"]["kept"]
    assert report["kept_width"] == hidden and kept < 1024 and report["mlp"].get("split") is None
    assert report["params"]["pruned"] <= report["allocation"]["budget"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "whole" / "model")
    assert model.config.hidden_size == hidden and model.config.intermediate_size == kept
    assert parameter_count(model) == report["params"]["pruned"]
    fixed = write_recipe(
        tmp_path / "b", wide_mlp, output=str(tmp_path / "fixed"), slicing=GLOBAL, mlp={"kept": kept}, **COMMON
    )
    assert main(["run", str(fixed)]) == 0
    assert json.loads((tmp_path / "fixed" / "report.json").read_text())["kept_width"] == hidden
    ours, theirs = (load_file(str(tmp_path / run / "model" / "model.safetensors")) for run in ("whole", "fixed"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("width", [64, 128])
def test_a_family_whose_stock_class_keeps_its_stream_takes_only_its_own_width(
    width: int, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Gemma 2's stock class keeps the stream whole (`models.mlp_only`): `slicing.kept` at its hidden
    size is what it does anyway, and is planned; any other width is one line."""
    checkpoint = save_tiny_checkpoint(tmp_path / "gemma2", "gemma2", hidden_size=128, intermediate_size=1024)
    eager = {"model__attn_implementation": "eager"}
    recipe = write_recipe(tmp_path, checkpoint, slicing={**GLOBAL, "kept": width}, mlp={}, **COMMON, **eager)
    capsys.readouterr()
    code = main(["run", str(recipe), "--dry-run"])
    err = capsys.readouterr().err
    if width == 128:
        assert code == 0, err
    else:
        assert code == 2 and "keeps its stream whole" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"slicing": {**GLOBAL, "kept": 60}, "mlp": {}}, "slicing.kept 60: give a multiple of 8"),
        ({"slicing": {**GLOBAL, "kept": 8}, "mlp": {}}, "slicing.kept 8 is narrower than the"),
        ({"slicing": {**GLOBAL, "kept": 4096}, "mlp": {}}, "up to the hidden size"),
        ({"slicing": {**GLOBAL, "kept": 64}}, "add mlp: {} without mlp.kept"),
        ({"slicing": {**GLOBAL, "kept": 64}, "mlp": {"kept": 512}}, "add mlp: {} without mlp.kept"),
        (
            {"slicing": {**GLOBAL, "kept": 64}, "mlp": {}, "sparsity": 0.2, "target_params": None},
            "and sparsity sets it too",
        ),
        ({"slicing": {"layout": "heterogeneous", "kept": 64}, "mlp": {}}, "keeps the stream whole"),
        ({"slicing": {**GLOBAL, "kept": 64}, "mlp": {}, "target_decode": 0.7}, "target_decode chooses the widths"),
        ({"slicing": {"kept": 64}, "mlp": {}, "allocation": {"method": "curves"}}, "remove allocation.method"),
    ],
)
def test_bad_fixed_widths_are_one_line_and_write_nothing(
    changes: dict, message: str, wide_mlp: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    recipe = write_recipe(tmp_path, wide_mlp, **{**COMMON, **changes})
    capsys.readouterr()
    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
