"""A global layout of a family whose class cannot hold a rotated stream prunes the MLP alone
(`compressor.models.mlp_only`): what the budget asks of it is checked before any work, in one line
that names what the MLP alone can reach and the setting that reaches further."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Mistral3Config

from compressor.cli import main
from compressor.errors import UserError
from compressor.models.families import family_for
from compressor.models.mlp_only import kept_stream
from compressor.models.towers import tower_for
from tests.conftest import COMMON, EXAMPLES, FAMILY_CONFIGS, TOKENIZER_FILES
from tests.run.test_cli import _DELETE, write_recipe

STOCK_MLP = {"slicing": {"layout": "global"}, "sparsity": _DELETE, "model__attn_implementation": "eager"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Gemma 3 config alone (the checks read no weights), with a vocabulary that makes the
    embedding most of the model, as in Gemma 3 270M."""
    folder = tmp_path_factory.mktemp("gemma3")
    config = AutoConfig.for_model(**{**COMMON, **FAMILY_CONFIGS["gemma3_text"], "vocab_size": 8192})
    config.architectures = ["Gemma3ForCausalLM"]
    config.save_pretrained(folder)
    for file in TOKENIZER_FILES:
        shutil.copy(EXAMPLES / "ref-llama" / file, folder / file)
    return folder


def _refusal(tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture, **changes) -> str:
    recipe = write_recipe(tmp_path, checkpoint, evaluation=None, **{**STOCK_MLP, **changes})
    assert main(["run", str(recipe), "--dry-run"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and error.startswith("error: "), error
    assert not (tmp_path / "out").exists()
    return error


def _params(checkpoint: Path, neurons: int) -> int:
    config = AutoConfig.from_pretrained(checkpoint)
    config.intermediate_size = neurons
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def test_a_budget_the_mlp_alone_cannot_reach_names_the_fraction_it_can(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    error = _refusal(tmp_path, checkpoint, capsys, target_params=0.75, mlp={})
    assert "a stock gemma3_text keeps its residual stream whole (its norms after each block" in error
    assert "set slicing.layout: per_site" in error
    reachable = float(re.search(r"raise target_params to at least ([0-9.]+)", error).group(1))
    # mlp.min_kept's 0.25 of 128 neurons, counted independently
    assert reachable == pytest.approx(_params(checkpoint, 32) / _params(checkpoint, 128), abs=1e-4)
    (tmp_path / "ok").mkdir()
    at = write_recipe(tmp_path / "ok", checkpoint, evaluation=None, target_params=reachable + 1e-4, mlp={}, **STOCK_MLP)
    assert main(["run", str(at), "--dry-run"]) == 0
    assert "every MLP keeps 32 of its 128 neurons" in capsys.readouterr().out


def test_the_non_embedding_budget_reaches_further(checkpoint: Path, tmp_path: Path, capsys) -> None:
    recipe = write_recipe(
        tmp_path, checkpoint, evaluation=None, target_params=0.75, budget="non_embedding", mlp={}, **STOCK_MLP
    )
    assert main(["run", str(recipe), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "axes: MLP width (this family allows residual, mlp, heads, depth; saved stock: mlp)" in out
    assert "saved as Gemma3ForCausalLM with its residual stream whole (hidden_size 64" in out
    kept = int(re.search(r"every MLP keeps (\d+) of its 128 neurons", out).group(1))
    tables = 8192 * 64
    budget = int(0.75 * (_params(checkpoint, 128) - tables))
    assert _params(checkpoint, kept) - tables <= budget < _params(checkpoint, kept + 8) - tables


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"sparsity": 0.25, "mlp": {}}, "sparsity cuts the residual width, but a stock gemma3_text keeps"),
        ({"target_params": 1.0, "mlp": {"kept": 120}, "refinement": {}}, "refinement moves residual bases"),
        ({"target_params": 1.0, "mlp": {"kept": 120}, "allocation": {"method": "curves"}}, "allocation.method"),
        ({"target_params": 0.9, "mlp": {"kept": 120}}, "MLPs of 120 neurons leave"),
    ],
    ids=["sparsity", "refinement", "allocation", "kept-over-budget"],
)
def test_what_a_stream_kept_whole_cannot_do_is_refused_before_work(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture, changes: dict, named: str
) -> None:
    assert named in _refusal(tmp_path, checkpoint, capsys, **changes)


def test_only_a_global_layout_of_a_class_that_cannot_hold_a_rotated_stream_keeps_it_whole() -> None:
    """`kept_stream` decides the layout: the family's or the vision-language class's reason, for a
    global layout with an MLP width to prune; a per-site layout and a stock-able class rotate."""
    gemma3, llama, gpt2 = family_for("gemma3_text"), family_for("llama"), family_for("gpt2")
    mistral3 = tower_for(Mistral3Config())
    assert kept_stream(gemma3, "global") == gemma3.stock_refusal and kept_stream(gemma3, "per_site") is None
    assert kept_stream(llama, "global") is None and kept_stream(gpt2, "global") is None  # rotated; refused
    assert kept_stream(llama, "global", mistral3) == mistral3.keeps_stream
    with pytest.raises(UserError, match="does not describe its MLP's width"):
        kept_stream(gpt2, "global", mistral3)
