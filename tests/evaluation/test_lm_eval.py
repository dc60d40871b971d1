"""lm-eval tasks run in-process on the dense and the pruned model, from a recipe and from `compress eval`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from compressor.cli import main
from compressor.evaluation.harness import _flatten
from tests.run.test_cli import write_recipe

# With a random model every token costs about log(vocab) nats, so the summed log-likelihood
# (lm-eval's `acc`) always prefers the one-word choice over the six-word one. Labels point at
# the short choice in 4 of 6 records: a harness that really scores with the model gets 4/6.
SHORT, LONG = "yes", "the quick brown fox jumps over"
RECORDS = [
    {"context": f"Question {i}: which line comes next?\n", "choices": choices, "label": label}
    for i, (choices, label) in enumerate(
        [
            ([SHORT, LONG], 0),
            ([LONG, SHORT], 1),
            ([SHORT, LONG], 1),
            ([LONG, SHORT], 0),
            ([SHORT, LONG], 0),
            ([LONG, SHORT], 1),
        ]
    )
]
SHORT_LABELLED = sum(r["choices"][r["label"]] == SHORT for r in RECORDS) / len(RECORDS)

TASK = {
    "task": "tiny_choice",
    "dataset_path": "json",
    "dataset_kwargs": {"data_files": {"test": "data/tiny_choice.jsonl"}},  # relative to the YAML's folder
    "test_split": "test",
    "output_type": "multiple_choice",
    "doc_to_text": "{{context}}",
    "doc_to_choice": "{{choices}}",
    "doc_to_target": "label",
    "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    "metadata": {"version": 1.0},
}


def _write_task(folder: Path) -> Path:
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "tiny_choice.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    path = folder / "tiny_choice.yaml"
    path.write_text(yaml.safe_dump(TASK))
    return path


def test_a_local_task_scores_both_models_in_the_report(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_task(tmp_path / "tasks")
    recipe = write_recipe(
        tmp_path, tiny_checkpoint, evaluation__lm_eval={"tasks": ["tasks/tiny_choice.yaml"], "batch_size": 4}
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # task files and their data resolve from the recipe and task folders
    assert main(["run", str(recipe)]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    for side in ("baseline", "pruned"):
        scores = report["metrics"][side]["tasks"]["tiny_choice"]
        assert scores["samples"] == len(RECORDS)
        assert scores["acc"] == pytest.approx(SHORT_LABELLED)
        assert scores["acc_stderr"] > 0
    assert SHORT_LABELLED == pytest.approx(4 / 6)
    assert "| tiny_choice acc (n=6) | 0.667 ± " in (tmp_path / "out" / "report.md").read_text()
    saved = yaml.safe_load((tmp_path / "out" / "recipe.yaml").read_text())
    assert saved["evaluation"]["lm_eval"][0]["tasks"] == [str(tmp_path / "tasks" / "tiny_choice.yaml")]

    # compress eval of the finished run: the recipe's suites by default, on the reloaded models
    assert main(["eval", str(tmp_path / "out"), "--output", str(tmp_path / "eval.json")]) == 0
    evaluated = json.loads((tmp_path / "eval.json").read_text())["metrics"]
    assert evaluated["pruned"]["tasks"] == report["metrics"]["pruned"]["tasks"]
    assert evaluated["baseline"]["tasks"] == report["metrics"]["baseline"]["tasks"]


def test_eval_runs_tasks_alone_from_an_include_path(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_task(tmp_path / "tasks")
    monkeypatch.chdir(tmp_path)
    assert (
        main(
            [
                "eval",
                str(tiny_checkpoint),
                "--tasks",
                "tiny_choice",
                "--include-path",
                "tasks",
                "--limit",
                "3",
                "--output",
                "eval.json",
            ]
        )
        == 0
    )
    metrics = json.loads((tmp_path / "eval.json").read_text())["metrics"]
    assert set(metrics) == {"pruned"}  # no reference, no perplexity data: the task alone
    assert metrics["pruned"]["tasks"]["tiny_choice"]["samples"] == 3
    first_three = sum(r["choices"][r["label"]] == SHORT for r in RECORDS[:3]) / 3
    assert metrics["pruned"]["tasks"]["tiny_choice"]["acc"] == pytest.approx(first_three)


@pytest.mark.parametrize(
    ("lm_eval", "message"),
    [
        ({"tasks": []}, "evaluation.lm_eval.0.tasks must not be empty (task names or task YAML files"),
        ({"tasks": ["missing.yaml"]}, "lm-eval task file not found"),
        ({"tasks": ["x"], "include_path": "nowhere"}, "lm-eval include_path is not a folder"),
        ({"tasks": ["x"], "limit": 0}, "evaluation.lm_eval.limit must be a whole number"),
        ({"tasks": ["x"], "limit": 10.5}, "evaluation.lm_eval.limit must be a whole number"),
        ({"tasks": ["x"], "shots": 5}, "unknown key 'evaluation.lm_eval.0.shots'"),
        ({"tasks": "arc_easy"}, "evaluation.lm_eval.0.tasks must be a list"),
        ([], "evaluation.lm_eval must hold at least one suite"),
        (
            {"tasks": ["tiny_choise"], "include_path": "tasks"},
            "unknown lm-eval task 'tiny_choise' (did you mean 'tiny_choice'?)",
        ),
    ],
)
def test_bad_lm_eval_sections_are_one_line(
    lm_eval: object, message: str, tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _write_task(tmp_path / "tasks")
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation__lm_eval=lm_eval)
    assert main(["run", str(recipe), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_lm_eval_metric_names_keep_a_filter_and_pair_with_their_error() -> None:
    flat = _flatten(
        {
            "alias": "gsm8k",
            "sample_len": 8,
            "exact_match,strict-match": 0.25,
            "exact_match_stderr,strict-match": 0.1,
            "acc,none": 0.5,
            "acc_stderr,none": "N/A",
        }
    )
    assert flat == {
        "samples": 8,
        "exact_match,strict-match": 0.25,
        "exact_match,strict-match_stderr": 0.1,
        "acc": 0.5,
        "acc_stderr": None,
    }


def test_a_task_named_in_two_suites_and_tags_are_refused(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _write_task(tmp_path / "tasks")
    twice = [{"tasks": ["tasks/tiny_choice.yaml"]}, {"tasks": ["tasks/tiny_choice.yaml"], "num_fewshot": 1}]
    assert main(["run", str(write_recipe(tmp_path, tiny_checkpoint, evaluation__lm_eval=twice)), "--dry-run"]) == 2
    assert "is named twice" in capsys.readouterr().err
    broken = tmp_path / "tasks" / "broken.yaml"
    broken.write_text("task: [unclosed\n")
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation__lm_eval={"tasks": ["tasks/broken.yaml"]})
    assert main(["run", str(recipe), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "cannot read lm-eval task" in err and err.count("\n") == 1


def test_hub_dataset_files_are_left_alone_and_local_ones_resolved(tmp_path: Path) -> None:
    from compressor.evaluation.harness import _local_config

    (tmp_path / "hub.yaml").write_text(
        yaml.safe_dump(
            {"task": "t", "dataset_path": "someone/dataset", "dataset_kwargs": {"data_files": {"test": "dev/x.csv"}}}
        )
    )
    assert _local_config(tmp_path / "hub.yaml")["dataset_kwargs"]["data_files"] == {"test": "dev/x.csv"}
    path = _write_task(tmp_path / "local")
    assert _local_config(path)["dataset_kwargs"]["data_files"] == {
        "test": str(tmp_path / "local" / "data" / "tiny_choice.jsonl")
    }


def test_editing_a_local_task_changes_its_digest(tmp_path: Path) -> None:
    from compressor.evaluation.harness import suite_digest
    from compressor.recipe.sections.evaluation import LmEvalSpec

    path = _write_task(tmp_path)
    spec = LmEvalSpec(tasks=[str(path)])
    before = suite_digest(spec)
    data = tmp_path / "data" / "tiny_choice.jsonl"
    data.write_text(data.read_text().replace("Question 0", "Question zero"))
    assert suite_digest(spec) != before
