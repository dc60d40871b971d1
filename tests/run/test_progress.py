"""Long inner loops move the progress bar: Stiefel steps, the τ-search's eigendecompositions,
refinement steps and lm-eval requests report (done, total) while they work, ending at total."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compressor.models.layout import fixed_layout
from compressor.strategies.contract import SiteProblem, SiteStatistics
from compressor_plugins.sensitivity import Sensitivity, TauGrid
from compressor_plugins.stiefel import Schedule, Stiefel
from tests.engine.test_sensitivity import random_psd

DOCUMENTED_DEFAULT_STEPS = 1_000
"""`stiefel`'s default steps, as measured and documented in docs/benchmarks.md (issue 24)."""


class Recorder:
    """A progress callable that keeps every call, and what the strategy had done by then."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, done: int, total: int) -> None:
        self.calls.append((done, total))


def _site(d: int = 16, keep: int = 10, seed: int = 0) -> tuple[SiteProblem, Recorder]:
    C, H = random_psd(d, seed=seed), random_psd(d, seed=seed + 1, decay=0.1)
    recorder = Recorder()
    problem = SiteProblem("site", 0, d, keep, SiteStatistics(C=C, tokens=1, extra={"H": H}), progress=recorder)
    return problem, recorder


def _rising_to_the_end(calls: list[tuple[int, int]], total: int) -> None:
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert {t for _, t in calls} == {total}
    done = [d for d, _ in calls]
    assert done == sorted(done)


def test_stiefel_reports_its_steps_while_it_optimises() -> None:
    problem, recorder = _site()
    basis = Stiefel().select(problem, None, Schedule(steps=300, patience=10_000, tolerance=0.0))
    assert basis.objectives["steps"] == 300
    _rising_to_the_end(recorder.calls, 300)
    inside = [d for d, _ in recorder.calls if 0 < d < 300]
    assert len(inside) >= 90  # every 1% of the steps (every 3rd step here), not only at the ends
    assert len(recorder.calls) <= 300 + 2  # and never more than once a step


def test_stiefel_that_stops_early_still_finishes_its_bar() -> None:
    problem, recorder = _site(seed=4)
    basis = Stiefel().select(problem, None, Schedule(steps=5_000, patience=1, tolerance=0.5))
    assert basis.objectives["steps"] < 5_000  # a relative gain of 50% a step cannot last
    _rising_to_the_end(recorder.calls, 5_000)


def test_stiefel_reports_on_time_between_the_1_percent_marks() -> None:
    """Slow steps (a wide site) still move the bar every `seconds`, not only every 1% of steps."""
    from compressor_plugins.stiefel import Ticker

    problem, recorder = _site()
    every_step = Ticker(problem, 1_000, seconds=0.0)
    for step in range(1, 21):
        every_step(step)
    assert recorder.calls == [(0, 1_000)] + [(step, 1_000) for step in range(1, 21)]
    recorder.calls.clear()
    on_the_marks = Ticker(problem, 1_000, seconds=3600.0)
    for step in range(1, 21):
        on_the_marks(step)
    assert recorder.calls == [(0, 1_000), (10, 1_000), (20, 1_000)]


def test_stiefel_default_steps_are_the_measured_ones() -> None:
    """A pipeline step `{strategy: stiefel}` with no options runs at most the documented number of
    steps (benchmarks/stiefel_steps.py; docs/benchmarks.md, issue 24), and its bar counts to it."""
    strategy = Stiefel()
    options = strategy.parse_options({})
    problem, recorder = _site(d=8, keep=6)
    basis = strategy.select(problem, None, options)
    assert recorder.calls[-1] == (DOCUMENTED_DEFAULT_STEPS, DOCUMENTED_DEFAULT_STEPS)
    assert 0 < basis.objectives["steps"] <= DOCUMENTED_DEFAULT_STEPS
    assert (
        f"{DOCUMENTED_DEFAULT_STEPS:,} steps"
        in Path(__file__)
        .parent.parent.parent.joinpath("docs", "benchmarks.md")
        .read_text()
        .split("Stiefel steps: what the default buys (issue 24)")[1]
    )


def test_sensitivity_reports_the_batched_grid_then_each_refined_tau() -> None:
    problem, recorder = _site()
    Sensitivity().select(problem, None, TauGrid(taus=(1.0, 10.0, 100.0), refine=3))
    total = 3 + 1 + 3  # the grid and PCA in one batch, then three golden-section eigendecompositions
    assert recorder.calls == [(0, total), (4, total), (5, total), (6, total), (7, total)]


def test_sensitivity_without_refinement_reports_before_and_after_its_one_batch() -> None:
    problem, recorder = _site()
    Sensitivity().select(problem, None, TauGrid())
    assert recorder.calls == [(0, 6), (6, 6)]


def test_the_engine_routes_a_strategy_s_progress_to_the_run_s_bar() -> None:
    from compressor.engine.pooling import PipelineStep
    from compressor.engine.walk import prune
    from compressor.engine.walk_options import WalkOptions
    from compressor.models.families import family_for
    from compressor.models.layout import kept_width
    from tests.conftest import random_batches, tiny_model, widths_for

    model = tiny_model("llama")
    family = family_for("llama")
    widths = widths_for(
        "llama",
        model.config,
        kept_width(model.config.hidden_size, 0.25, 8),
        slice_head=family.head_width_is_embedding_width,
    )
    batches = random_batches(model.config.vocab_size)
    seen: list[tuple[str, int, int]] = []
    prune(
        model,
        fixed_layout(model.config, family, widths),
        batches,
        [PipelineStep(Stiefel(), Schedule(steps=50, patience=10_000, tolerance=0.0))],
        WalkOptions(progress=lambda phase, done, total: seen.append((phase, done, total))),
    )
    stiefel = [call for call in seen if call[0].endswith(": stiefel")]
    assert stiefel and stiefel[-1][0].startswith("site ") and stiefel[-1][1:] == (50, 50)
    assert any(0 < done < 50 for _, done, _ in stiefel)


def test_refinement_reports_every_step() -> None:
    from compressor.engine.refine import RefinementRun, refine_bases
    from compressor.recipe.sections.refinement import RefinementSpec
    from tests.conftest import copy_model, random_batches, tiny_model
    from tests.engine.test_refine import _pca_bases

    batches = random_batches(tiny_model("llama").config.vocab_size, padded=True)
    original, family, result = _pca_bases("llama", batches, sparsity=0.5)
    seen: list[tuple[str, int, int]] = []
    _, record, _ = refine_bases(
        copy_model(original),
        family,
        batches,
        result.bases,
        RefinementSpec(epochs=3, lr=0.05, batch_size=2, top_k=0),
        RefinementRun(progress=lambda phase, done, total: seen.append((phase, done, total))),
    )
    steps = [(done, total) for phase, done, total in seen if phase == "refinement: Riemannian Adam on the KL"]
    assert record.steps == 12
    assert steps == [(step, 12) for step in range(1, 13)]


def test_lm_eval_reports_its_tasks_and_each_answered_request(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A local multiple-choice task: 6 documents of 2 choices are 12 loglikelihood requests, answered
    in batches of 4; the bar hears the task prepared, then the requests counted up to 12."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import compressor.evaluation.harness as harness
    from compressor.evaluation.metrics import task_scores
    from compressor.recipe.sections.evaluation import LmEvalSpec
    from tests.evaluation.test_lm_eval import RECORDS, _write_task

    path = _write_task(tmp_path / "tasks")
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    unthrottled = harness._watch_requests
    monkeypatch.setattr(
        harness, "_watch_requests", lambda wrapper, report, what: unthrottled(wrapper, report, what, seconds=0.0)
    )
    seen: list[tuple[str, int, int]] = []
    scores = task_scores(
        model,
        tokenizer,
        [LmEvalSpec(tasks=[str(path)], batch_size=4)],
        torch.device("cpu"),
        progress=lambda phase, done, total: seen.append((phase, done, total)),
    )
    assert scores["tiny_choice"]["samples"] == len(RECORDS)
    assert seen[0] == ("tiny_choice: preparing the tasks", 0, 1)
    requests = [(done, total) for phase, done, total in seen if phase == "tiny_choice: loglikelihood requests"]
    total = 2 * len(RECORDS)
    assert requests[0] == (0, total) and requests[-1] == (total, total)
    assert [done for done, _ in requests] == sorted(done for done, _ in requests)
    assert any(0 < done < total for done, _ in requests)  # counted as batches finish, not only at the end
    assert "Running loglikelihood requests" not in capsys.readouterr().err  # ours is the only bar


def test_a_run_s_lm_eval_phases_name_the_model(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Through `evaluate_models`, as a run calls it: each model's requests, under its name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compressor.evaluation.metrics import TaskOptions, evaluate_models
    from compressor.recipe.sections.evaluation import LmEvalSpec
    from tests.evaluation.test_lm_eval import RECORDS, _write_task

    path = _write_task(tmp_path / "tasks")
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    seen: list[tuple[str, int, int]] = []
    evaluate_models(
        model,
        model,
        None,
        torch.device("cpu"),
        lambda *call: seen.append(call),
        TaskOptions([LmEvalSpec(tasks=[str(path)], batch_size=4)], tokenizer),
    )
    for side in ("original", "pruned"):
        assert (
            f"lm-eval, {side} model: tiny_choice: loglikelihood requests",
            2 * len(RECORDS),
            2 * len(RECORDS),
        ) in seen
