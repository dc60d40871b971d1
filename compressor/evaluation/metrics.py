"""Quality of a pruned model against the original: perplexity of each, and
KL(p_original ‖ p_pruned) in nats, averaged over predicted tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from compressor.data.batches import Batch
from compressor.recipe.sections.evaluation import LmEvalSpec


@torch.no_grad()
def model_log_probs(model: PreTrainedModel, batch: Batch, device: torch.device) -> torch.Tensor:
    """`model`'s next-token log-probabilities on `batch` (`log_probs_of`), without a cache."""
    ids = batch.input_ids.to(device)
    logits = model(input_ids=ids, attention_mask=batch.attention_mask.to(device), use_cache=False).logits
    return log_probs_of(logits)


class Tally:
    """Perplexities and mean per-token KL(original ‖ pruned), summed batch by batch from each
    model's log-probabilities; a token counts when it and the token it predicts are both real."""

    def __init__(self) -> None:
        self.nll = {"baseline": 0.0, "pruned": 0.0}
        self.kl_sum, self.count = 0.0, 0

    def add(self, reference: torch.Tensor | None, candidate: torch.Tensor, batch: Batch, device: torch.device) -> None:
        targets = batch.input_ids[:, 1:].to(device)
        mask = (batch.attention_mask[:, 1:] * batch.attention_mask[:, :-1]).to(device).bool()
        for name, logp in (("baseline", reference), ("pruned", candidate)):
            if logp is not None:
                self.nll[name] -= logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)[mask].double().sum().item()
        if reference is not None:
            kl = (reference.exp() * (reference - candidate)).sum(-1)
            self.kl_sum += kl[mask].double().sum().item()
        self.count += int(mask.sum())

    def result(self, with_original: bool) -> dict[str, dict[str, float]]:
        def summary(name: str) -> dict[str, float]:
            return {"ppl": float(torch.tensor(self.nll[name] / self.count).exp()), "nll": self.nll[name] / self.count}

        if not with_original:
            return {"pruned": summary("pruned"), "tokens": {"count": self.count}}
        return {
            "baseline": summary("baseline"),
            "pruned": {**summary("pruned"), "kl": self.kl_sum / self.count},
            "tokens": {"count": self.count},
        }


def log_probs_of(logits: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities in float32, the last position dropped."""
    return F.log_softmax(logits[:, :-1].float(), dim=-1)


@torch.no_grad()
def compare(
    original: PreTrainedModel | None,
    pruned: PreTrainedModel,
    batches: list[Batch],
    device: torch.device,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, dict[str, float]]:
    """Perplexities of both models and the mean per-token KL from original to pruned; with no
    `original`, the perplexity of `pruned` alone (`Tally`)."""
    tally = Tally()
    for index, batch in enumerate(batches):
        reference = model_log_probs(original, batch, device) if original is not None else None
        tally.add(reference, model_log_probs(pruned, batch, device), batch, device)
        if progress:
            progress(index + 1, len(batches))
    return tally.result(original is not None)


def kl_to_references(
    references: list[torch.Tensor], model: PreTrainedModel, windows: list[Batch], device: torch.device
) -> float:
    """KL(reference ‖ `model`) on `windows`, from the reference's log-probabilities of each (on any
    device): what a stage that measures candidates against the original computes for each."""
    tally = Tally()
    for batch, reference in zip(windows, references, strict=True):
        tally.add(reference.to(device), model_log_probs(model, batch, device), batch, device)
    return tally.result(True)["pruned"]["kl"]


@dataclass(frozen=True)
class TaskOptions:
    """The lm-eval suites `evaluate_models` runs on both models, and what they run with."""

    tasks: list[LmEvalSpec] | None = None
    """The suites (None or empty: none)."""
    tokenizer: Any = None
    seed: int = 0
    baseline_tasks: dict[str, Any] | None = None
    """The original's scores when they are known already (a sweep scores the dense model once)."""


def evaluate_models(
    original: PreTrainedModel | None,
    pruned: PreTrainedModel,
    batches: list[Batch] | None,
    device: torch.device,
    progress: Callable[[str, int, int], None] | None = None,
    suites: TaskOptions = TaskOptions(),
) -> dict[str, Any]:
    """`compare` (unless `batches` is None: task scores only), then the lm-eval task suites on
    both models (both already on `device`), under `metrics.<model>.tasks` (`TaskOptions`)."""
    tasks, tokenizer, seed, baseline_tasks = suites.tasks, suites.tokenizer, suites.seed, suites.baseline_tasks
    report = progress or (lambda *_: None)
    if batches is not None:
        metrics: dict[str, Any] = compare(
            original, pruned, batches, device, lambda done, total: report("evaluating", done, total)
        )
    else:
        metrics = {**({"baseline": {}} if original is not None else {}), "pruned": {}}
    if tasks:
        if original is not None:
            if baseline_tasks is None:
                report("lm-eval: original model", 0, 1)
                baseline_tasks = task_scores(
                    original,
                    tokenizer,
                    tasks,
                    device,
                    seed,
                    lambda phase, done, total: report(f"lm-eval, original model: {phase}", done, total),
                )
            metrics["baseline"]["tasks"] = baseline_tasks
        report("lm-eval: pruned model", 0, 1)
        metrics["pruned"]["tasks"] = task_scores(
            pruned,
            tokenizer,
            tasks,
            device,
            seed,
            lambda phase, done, total: report(f"lm-eval, pruned model: {phase}", done, total),
        )
    return metrics


def task_scores(
    model: PreTrainedModel,
    tokenizer: Any,
    suites: list[LmEvalSpec],
    device: torch.device,
    seed: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """Every suite's lm-eval scores, `{task: {metric: value}}` (imports lm-eval only when asked).
    `progress(phase, done, total)` hears each suite's tasks and requests (`harness.run_tasks`)."""
    from compressor.evaluation.harness import run_tasks

    report = progress or (lambda *_: None)
    scores: dict[str, Any] = {}
    for number, suite in enumerate(suites, 1):
        where = f"suite {number}/{len(suites)}, " if len(suites) > 1 else ""
        scores.update(
            run_tasks(
                model,
                tokenizer,
                suite,
                device,
                seed,
                lambda phase, done, total, where=where: report(f"{where}{phase}", done, total),
            )
        )
    return scores


def parameter_count(model: PreTrainedModel) -> int:
    return sum(p.numel() for p in model.parameters())
