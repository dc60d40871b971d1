"""`report.json` is one typed model (`reports.report_model`): what the runner writes is what every
reader loads, field for field, and a field that is not declared fails where it is written or read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from compressor.cli import main
from compressor.commands.compare import read_report
from compressor.errors import UserError
from compressor.reports.report_model import RunReport, to_json
from tests.reports import report_dict
from tests.run.test_cli import write_recipe


def test_a_run_report_reads_back_as_written(tmp_path: Path, tiny_checkpoint: Path) -> None:
    """A run with every optional section (refinement, its guard, distillation, site records) written
    by the runner, loaded by the readers' model, and written again: the same text."""
    recipe = write_recipe(
        tmp_path,
        tiny_checkpoint,
        refinement={"windows": 2, "epochs": 1, "batch_size": 2, "top_k": 8, "heldout_windows": 2},
        distillation={"tokens": 512, "seq_len": 32, "batch_size": 4, "heldout_windows": 4, "eval_every": 2},
    )
    assert main(["run", str(recipe)]) == 0
    path = tmp_path / "out" / "report.json"
    report = read_report(tmp_path / "out")
    assert to_json(report) == path.read_text()
    assert report.refinement is not None and report.distillation is not None and len(report.guards) == 2
    assert report.sites[0].name == "embedding" and report.metrics.pruned is not None
    assert report.metrics.pruned.kl == json.loads(path.read_text())["metrics"]["pruned"]["kl"]


def test_an_undeclared_field_fails_where_it_is_written_and_where_it_is_read(tmp_path: Path) -> None:
    fields = report_dict()
    with pytest.raises(ValidationError, match="kept_widht"):
        RunReport.model_validate({**fields, "kept_widht": 192})  # a misspelt field, written
    with pytest.raises(ValidationError, match="pll"):
        RunReport.model_validate({**fields, "metrics": {"pruned": {"pll": 3.0}}})  # ...or nested
    (tmp_path / "report.json").write_text(json.dumps({**fields, "params": {"baseline": 1, "pruned": 1}}))
    with pytest.raises(UserError, match=r"is not a run report of compressor .* \(no params\.ratio\)"):
        read_report(tmp_path)


def test_a_built_in_stage_s_time_is_never_shown_as_a_plugin_s() -> None:
    """report.md's time rows: each built-in stage's key is one of the named rows' (a heads run showed
    "attention heads time" and "heads time" both), and a plugin stage's key gets its own row."""
    from compressor.reports.report import BUILT_IN_TIMINGS, timing_rows
    from compressor.stages.order import BUILTIN_STAGES

    keys = {stage.timing for stage in BUILTIN_STAGES if stage.timing is not None}
    assert keys <= BUILT_IN_TIMINGS, keys - BUILT_IN_TIMINGS
    labels = [row[0] for row in timing_rows({**dict.fromkeys(keys, 1.0), "prune_s": 1.0, "my_stage_s": 2.0})]
    assert len(labels) == len(set(labels)) and "my_stage time (s)" in labels
    assert "attention heads time (s)" in labels and "experts time (s)" in labels
