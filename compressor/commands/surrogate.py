"""Does H rank directions by their effect on the output? (the paper's Figure 2a, as a command)

At one site, with the reconstruction error held fixed, the local model predicts the mean
per-token output KL of removing a unit direction u as

    predicted(u) = ½·α²·(uᵀHu)·(uᵀCu),   α² = E / uᵀCu,

where the stream is perturbed at every token by x ← x − α·u uᵀx, so the activation energy
removed, α²·uᵀCu, is the same E for every direction (by default: the energy PCA discards at
the recipe's sparsity, Tr of C's `remove` smallest eigenvalues, i.e. "the error induced at 25%
pruning"). The measured KL is the mean per-token KL(original ‖ perturbed) on held-out windows,
over every real token (the same outputs H's sampled objective counts).

With E fixed, the activation energy cannot tell directions apart (SliceGPT's objective is the
same E for all of them), and the prediction reduces to ½·E·uᵀHu: the rank correlation between
predicted and measured KL says whether H ranks directions by their effect on the output.
Reported next to it: the rank correlation among random directions only (the paper's setting;
their costs spread little, so it is the harder test), and the rank correlation of the measured
KL with uᵀCu, the direction's activation variance: what a variance-only view (the ordering
PCA uses) says about output damage per unit of removed energy. Over all directions that one is
inflated because C and H share their top directions; among random directions
(`spearman_variance_random`) it is the clean baseline for `spearman_random`. `ratio_median` (measured over
predicted) shows how far the absolute scale holds (cross-token terms and a shared H are the
approximations; the scale is meaningful for `sensitivity.reduction: sum`, the default).

Directions: `directions` random unit vectors (Gaussian, normalised), plus, so that the costs span
a wide range, `eigenvectors` of each of: eigenvectors of C and of H at evenly spaced ranks (top
to bottom), and the bottom eigenvectors of τĈ + Ĥ/τ (Ĉ, Ĥ Frobenius-normalised, τ log-spaced
in [10⁻², 10²]): the rank-one minimisers of (uᵀCu)(uᵀHu) (Proposition 1), i.e. what the
sensitivity strategy removes first, from H-driven (small τ) to PCA-driven (large τ). (Those
minimise the cost of removing u outright, α = 1; at fixed energy the cheapest direction is H's
bottom eigenvector, which the small-τ end approaches.)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from compressor.data.batches import Batch
from compressor.engine.activations import held_on
from compressor.engine.calibration import LayerInputs, SecondMoment, capture_layer_inputs
from compressor.engine.fisher import FisherCall, estimate_fisher
from compressor.engine.transforms import fuse_norms
from compressor.errors import UserError
from compressor.models.families import ModelFamily
from compressor.models.sites import site_ids
from compressor.models.sliced import SlicedDecoderLayer
from compressor.plan.checks import plan
from compressor.recipe.schema import Recipe
from compressor.recipe.sections.sensitivity import SensitivityOptions
from compressor.runtime.loading import load_model, load_tokenizer, resolve_device, token_batches
from compressor.strategies.contract import coupled_loss, eigh_descending, frobenius_normalised
from compressor.strategies.registry import PluginRegistry

Progress = Callable[[str, int, int], None]
"""Called as (phase description, steps done, steps in total), like `compressor.run.runner`'s."""

JSON_FILE = "surrogate.json"
PLOT_FILE = "surrogate.png"

KINDS = {
    "random": "random",
    "C-eigenvector": "eigenvector of C",
    "H-eigenvector": "eigenvector of H",
    "tau-minimiser": "bottom of τC + H/τ",
}
"""Row kinds, in plot order, with their legend labels."""

TAUS = (1e-2, 1e2)
"""Range of τ for the rank-one minimisers (log-spaced)."""


# --- small pieces, shared with benchmarks/fisher_check.py -----------------------------------


def check_site(family: ModelFamily, num_layers: int, site: str) -> int:
    """The index of `site` in stream order; an unknown id is a one-line UserError naming valid ones."""
    ids = site_ids(family, num_layers)
    if site not in ids:
        shown = ids if len(ids) <= 7 else [*ids[:5], "…", ids[-1]]
        raise UserError(f"unknown site '{site}'; sites are {', '.join(shown)} ({len(ids)} in all)")
    return ids.index(site)


def rank_correlation(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's ρ (Pearson's r of the ranks, ties given their average rank); None when it is
    undefined (fewer than 3 points, or either side constant). In torch: scipy is not a dependency."""
    if len(a) != len(b):
        raise ValueError(f"rank_correlation needs equal lengths, got {len(a)} and {len(b)}")
    if len(a) < 3:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = (ra.square().sum() * rb.square().sum()).sqrt()
    if denominator == 0:
        return None
    return float((ra * rb).sum() / denominator)


def _ranks(values: Sequence[float]) -> torch.Tensor:
    t = torch.tensor(list(values), dtype=torch.float64)
    order = t.argsort(stable=True)
    ranks = torch.empty_like(t)
    ranks[order] = torch.arange(len(t), dtype=torch.float64)
    _, inverse, counts = torch.unique(t, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float64).scatter_add_(0, inverse, ranks)
    return (sums / counts)[inverse]


def predicted_kl(C: torch.Tensor, H: torch.Tensor, U: torch.Tensor, alpha: float) -> float:
    """½·α²·Tr(UᵀCU·UᵀHU): the local model's mean per-token KL of x ← x − α·UUᵀx
    (token-separable second order, one H shared by all tokens). For a unit u: ½α²(uᵀHu)(uᵀCu)."""
    return 0.5 * alpha**2 * coupled_loss(C, H, U)


def pca_energy(C: torch.Tensor, remove: int) -> float:
    """Tr of C's `remove` smallest eigenvalues: the activation energy PCA discards removing that many."""
    values, _ = eigh_descending(C)
    return float(values[values.shape[0] - remove :].clamp_min(0).sum())


def ensure_fused(model: PreTrainedModel, family: ModelFamily) -> None:
    """The diagnostics walk the stream site by site, which needs the fused layers; fusing leaves
    the function (and the stream at every site) unchanged."""
    if not isinstance(model.get_submodule(family.layers)[0], SlicedDecoderLayer):
        fuse_norms(model, family)


def _blocks(model: PreTrainedModel, family: ModelFamily) -> list[tuple[int, Callable[..., torch.Tensor]]]:
    """(layer index, block) in stream order: the stream at site s is the output of blocks[:s]."""
    return [
        (index, site.block)
        for index, layer in enumerate(model.get_submodule(family.layers))
        for site in layer.sites(family)
    ]


def _through(
    blocks: Sequence[tuple[int, Callable[..., torch.Tensor]]], hidden: torch.Tensor, kwargs: Sequence[dict[str, Any]]
) -> torch.Tensor:
    for layer, block in blocks:
        hidden = block(hidden, **kwargs[layer])
    return hidden


@dataclass(frozen=True)
class Measuring:
    """Where and how a site's statistics and KLs are measured: what `site_statistics`, `measure_kl`
    and the check they make up share (and benchmarks/fisher_check.py)."""

    device: torch.device | str = "cpu"
    """Where the model runs (H visits it a layer at a time; C and the KL need the whole model there)."""
    sensitivity: SensitivityOptions | None = None
    """H's options (None: the defaults)."""
    seed: int = 0
    """Seeds H's sampled labels, and the check's random directions."""
    progress: Progress | None = None


def site_statistics(
    model: PreTrainedModel, family: ModelFamily, inputs: LayerInputs, site: str, measuring: Measuring
) -> tuple[torch.Tensor, torch.Tensor]:
    """C = E[x xᵀ] (real tokens) and H (the recipe's estimator) at `site`, float64 on the host,
    from the captured inputs of the fused model. H goes through `estimate_fisher` (layers visit
    the device one at a time); C needs a forward up to the site with the model on the device."""
    index = check_site(family, model.config.num_hidden_layers, site)
    device, sensitivity = torch.device(measuring.device), measuring.sensitivity or SensitivityOptions()
    report = measuring.progress or (lambda *_: None)
    phase = "estimating output sensitivity (H)"
    call = FisherCall(lambda done, total: report(phase, done, total))
    H = estimate_fisher(model, family, inputs, sensitivity, device, measuring.seed, call)[site].to(torch.float64)
    blocks = _blocks(model, family)[:index]
    moment = SecondMoment(model.config.hidden_size, device)
    with torch.no_grad(), held_on([model], device):
        for b in range(len(inputs)):
            report("second moment (C)", b, len(inputs))
            kwargs = [inputs.kwargs(b, i, device) for i in range(model.config.num_hidden_layers)]
            hidden = _through(blocks, inputs.hidden.get(b, device), kwargs)
            moment.add(hidden, inputs.token_masks[b], inputs.token_counts[b])
        report("second moment (C)", len(inputs), len(inputs))
    return moment.value().cpu(), H.cpu()


@torch.no_grad()
def measure_kl(
    model: PreTrainedModel,
    family: ModelFamily,
    inputs: LayerInputs,
    site: str,
    perturbations: Sequence[tuple[torch.Tensor, float]],
    measuring: Measuring,
) -> tuple[list[float], int]:
    """Mean per-token KL(original ‖ perturbed), in nats over real tokens, for each (U, α): the
    stream at `site` replaced by x − α·UUᵀx at every token (U: d × k orthonormal). Also the token
    count. Each batch goes up to the site once and only the rest of the model is rerun per
    perturbation. The whole model visits the device (a diagnostic: it must fit there)."""
    index = check_site(family, model.config.num_hidden_layers, site)
    device, report = torch.device(measuring.device), measuring.progress or (lambda *_: None)
    blocks = _blocks(model, family)
    sums = [0.0] * len(perturbations)
    tokens = 0
    with held_on([model], device):
        dtype = next(model.parameters()).dtype
        moved = [(U.to(device, dtype), alpha) for U, alpha in perturbations]
        steps = len(inputs) * len(moved)
        for b in range(len(inputs)):
            report("measuring KL", b * len(moved), steps)
            kwargs = [inputs.kwargs(b, i, device) for i in range(model.config.num_hidden_layers)]
            mask = inputs.token_masks[b].to(device)
            x = _through(blocks[:index], inputs.hidden.get(b, device), kwargs)
            reference = _log_probs(model, family, _through(blocks[index:], x, kwargs))
            probs = reference.exp()
            for j, (U, alpha) in enumerate(moved):
                perturbed = _through(blocks[index:], x - alpha * (x @ U) @ U.T, kwargs)
                kl = (probs * (reference - _log_probs(model, family, perturbed))).sum(-1)
                sums[j] += kl[mask].double().sum().item()
                report("measuring KL", b * len(moved) + j + 1, steps)
            tokens += inputs.token_counts[b]
    if tokens == 0:
        raise ValueError("no evaluation tokens were counted (all positions masked)")
    if not all(math.isfinite(total) for total in sums):
        raise ValueError(f"the KL at {site} is not finite: the model's outputs overflowed (NaN or inf)")
    return [total / tokens for total in sums], tokens


def _log_probs(model: PreTrainedModel, family: ModelFamily, hidden: torch.Tensor) -> torch.Tensor:
    logits = family.logits(model, hidden)
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


# --- the check -----------------------------------------------------------------------------


@dataclass
class SurrogateResult:
    """One site's check: a row per direction (kind, predicted and measured KL, α, uᵀCu, uᵀHu)."""

    site: str
    rows: list[dict[str, Any]]
    settings: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)

    def _column(self, key: str, kind: str | None = None) -> list[float]:
        return [r[key] for r in self.rows if kind is None or r["kind"] == kind]

    @property
    def spearman(self) -> float | None:
        """ρ(predicted, measured) over every direction: the figure's headline number."""
        return rank_correlation(self._column("predicted"), self._column("measured"))

    @property
    def spearman_random(self) -> float | None:
        """ρ(predicted, measured) among the random directions only."""
        return rank_correlation(self._column("predicted", "random"), self._column("measured", "random"))

    @property
    def spearman_variance(self) -> float | None:
        """ρ(uᵀCu, measured): what the direction's activation variance alone says, at equal removed
        energy. Over all directions it is inflated where C and H share their top directions."""
        return rank_correlation(self._column("uCu"), self._column("measured"))

    @property
    def spearman_variance_random(self) -> float | None:
        """ρ(uᵀCu, measured) among the random directions: the variance-only baseline for `spearman_random`."""
        return rank_correlation(self._column("uCu", "random"), self._column("measured", "random"))

    @property
    def ratio_median(self) -> float | None:
        ratios = [r["measured"] / r["predicted"] for r in self.rows if r["predicted"] > 0]
        return float(torch.tensor(ratios, dtype=torch.float64).median()) if ratios else None

    def to_json(self) -> dict[str, Any]:
        kinds = {kind: len(self._column("kind", kind)) for kind in KINDS if self._column("kind", kind)}
        return {
            "site": self.site,
            "directions": len(self.rows),
            "kinds": kinds,
            "spearman": self.spearman,
            "spearman_random": self.spearman_random,
            "spearman_variance": self.spearman_variance,
            "spearman_variance_random": self.spearman_variance_random,
            "ratio_median": self.ratio_median,
            "settings": self.settings,
            "timings": self.timings,
            "rows": self.rows,
        }

    def plot(self, path: str | Path) -> None:
        """A PNG scatter, log–log, predicted vs measured KL coloured by kind, with the line where
        they are equal (how far the absolute scale holds) and ρ in the title."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        figure = Figure(figsize=(6.4, 5.2), layout="constrained")
        FigureCanvasAgg(figure)  # Agg, without touching pyplot's global backend
        axes = figure.add_subplot()
        shown = [r for r in self.rows if r["predicted"] > 0 and r["measured"] > 0]
        for kind, label in KINDS.items():
            points = [r for r in shown if r["kind"] == kind]
            if points:
                axes.scatter(
                    [r["predicted"] for r in points],
                    [r["measured"] for r in points],
                    s=22,
                    alpha=0.8,
                    label=f"{label} ({len(points)})",
                    edgecolors="none",
                )
        if shown:
            values = [v for r in shown for v in (r["predicted"], r["measured"])]
            low, high = min(values) / 1.5, max(values) * 1.5
            axes.plot([low, high], [low, high], color="grey", linestyle="--", linewidth=1, label="measured = predicted")
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xlabel("predicted KL  ½α²(uᵀHu)(uᵀCu)")
        axes.set_ylabel("measured KL (nats per token)")
        hidden = len(self.rows) - len(shown)
        note = f"; {hidden} non-positive not shown" if hidden else ""
        axes.set_title(
            f"{self.site}: Spearman ρ = {_fmt(self.spearman)} (random only: {_fmt(self.spearman_random)}; "
            f"their variance uᵀCu alone: {_fmt(self.spearman_variance_random)})\n"
            f"removed energy α²uᵀCu fixed at {self.settings.get('energy', float('nan')):.3g}{note}",
            fontsize=9,
        )
        axes.legend(fontsize=8)
        axes.grid(True, which="major", alpha=0.3)
        figure.savefig(path, format="png", dpi=150)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def probe_directions(
    C: torch.Tensor, H: torch.Tensor, random: int, eigenvectors: int, seed: int
) -> list[tuple[str, str, torch.Tensor]]:
    """(kind, detail, unit vector) for every direction of the check (see the module docstring)."""
    d = C.shape[0]
    generator = torch.Generator().manual_seed(seed)
    found: list[tuple[str, str, torch.Tensor]] = []
    for i, u in enumerate(torch.randn(random, d, generator=generator, dtype=torch.float64)):
        found.append(("random", f"random {i}", u / u.norm()))
    if eigenvectors > 0:
        ranks = sorted({round(r) for r in torch.linspace(0, d - 1, eigenvectors).tolist()})
        for name, matrix in (("C", C), ("H", H)):
            _, vectors = eigh_descending(matrix)
            found += [(f"{name}-eigenvector", f"{name} rank {r + 1}/{d}", vectors[:, r].clone()) for r in ranks]
        Cn, Hn = frobenius_normalised(C), frobenius_normalised(H)
        for tau in torch.logspace(math.log10(TAUS[0]), math.log10(TAUS[1]), eigenvectors, dtype=torch.float64).tolist():
            _, vectors = eigh_descending(tau * Cn + Hn / tau)
            found.append(("tau-minimiser", f"τ={tau:.3g}", vectors[:, -1].clone()))
    return found


def _probes(
    C: torch.Tensor, H: torch.Tensor, energy: float, directions: int, eigenvectors: int, seed: int
) -> tuple[list[dict[str, Any]], list[tuple[torch.Tensor, float]], int]:
    """Each probe direction's row (its predicted KL at the removed `energy`) and perturbation; a
    direction with (numerically) no variance cannot reach that energy and is counted as skipped."""
    floor = 1e-12 * float(torch.linalg.eigvalsh(C).max())
    rows, perturbations, skipped = [], [], 0
    for kind, detail, u in probe_directions(C, H, directions, eigenvectors, seed):
        uCu, uHu = float(u @ C @ u), float(u @ H @ u)
        if uCu <= floor:
            skipped += 1
            continue
        alpha = math.sqrt(energy / uCu)
        U = u.unsqueeze(1)
        rows.append(
            {
                "kind": kind,
                "detail": detail,
                "predicted": predicted_kl(C, H, U, alpha),
                "measured": None,
                "alpha": alpha,
                "uCu": uCu,
                "uHu": uHu,
            }
        )
        perturbations.append((U, alpha))
    return rows, perturbations, skipped


@dataclass(frozen=True)
class SurrogateOptions:
    """What one site's check probes beside the model and data: how many directions of each kind,
    the energy each removes, and where and how it measures (`Measuring`)."""

    directions: int
    """Random unit directions (Gaussian, normalised)."""
    remove: int | None = None
    """The removed energy is what PCA discards removing this many directions (unless `energy`)."""
    energy: float | None = None
    """The removed energy itself."""
    eigenvectors: int = 8
    """Of each structured kind (C's and H's eigenvectors, the τ-minimisers)."""
    measuring: Measuring = Measuring()


def surrogate_check(
    model: PreTrainedModel,
    family: ModelFamily,
    calibration: list[Batch],
    evaluation: list[Batch],
    site: str,
    options: SurrogateOptions,
) -> SurrogateResult:
    """Predicted vs measured KL of removing single directions at `site`, at fixed removed energy.

    C and H come from `calibration`, the measured KL from `evaluation` (see the module
    docstring for the directions). The removed energy is `options.energy` if given, else the
    energy PCA discards removing `options.remove` directions. A direction with (numerically) no
    variance at the site cannot reach that energy and is left out (counted in `settings.skipped`).
    The model (unpruned) has its norms fused in place if they are not already: its function is
    unchanged.
    """
    measuring = _checked(model, family, site, options)
    device, sensitivity = torch.device(measuring.device), measuring.sensitivity or SensitivityOptions()
    report = measuring.progress or (lambda *_: None)
    started = time.perf_counter()
    model.eval().requires_grad_(False)
    report("fusing norms", 0, 1)
    ensure_fused(model, family)
    report("capturing layer inputs", 0, 1)
    calib_inputs = capture_layer_inputs(model, family, calibration, device)
    C, H = site_statistics(model, family, calib_inputs, site, measuring)
    del calib_inputs
    energy = _removed_energy(C, options)
    statistics_s = time.perf_counter() - started

    rows, perturbations, skipped = _probes(C, H, energy, options.directions, options.eigenvectors, measuring.seed)
    tick = time.perf_counter()
    report("capturing evaluation inputs", 0, 1)
    eval_inputs = capture_layer_inputs(model, family, evaluation, device)
    measured, tokens = measure_kl(model, family, eval_inputs, site, perturbations, measuring)
    for row, value in zip(rows, measured):
        row["measured"] = value
    settings = {
        "energy": energy,
        "remove": options.remove,
        "width": C.shape[0],
        "random": options.directions,
        "eigenvectors": options.eigenvectors,
        "taus": list(TAUS),
        "seed": measuring.seed,
        "skipped": skipped,
        "calibration_tokens": sum(int(b.attention_mask.sum()) for b in calibration),
        "evaluation_tokens": tokens,
        "sensitivity": dataclasses.asdict(sensitivity),
    }
    timings = {
        "statistics_s": statistics_s,
        "measure_s": time.perf_counter() - tick,
        "total_s": time.perf_counter() - started,
    }
    return SurrogateResult(site=site, rows=rows, settings=settings, timings=timings)


def _checked(model: PreTrainedModel, family: ModelFamily, site: str, options: SurrogateOptions) -> Measuring:
    """The check's options refused where they cannot make a check; its `Measuring` on a `torch.device`
    with H's options filled in."""
    measuring = options.measuring
    device = torch.device(measuring.device)
    check_site(family, model.config.num_hidden_layers, site)
    if options.directions < 0 or options.eigenvectors < 0:
        raise ValueError("directions and eigenvectors must be non-negative")
    if options.energy is None and options.remove is None:
        raise ValueError("give the removed energy: `energy`, or `remove` (PCA's energy removing that many)")
    return dataclasses.replace(measuring, device=device, sensitivity=measuring.sensitivity or SensitivityOptions())


def _removed_energy(C: torch.Tensor, options: SurrogateOptions) -> float:
    """`options.energy`, else what PCA discards removing `options.remove` directions; refused unless positive."""
    d, energy, remove = C.shape[0], options.energy, options.remove
    if energy is None:
        assert remove is not None
        if not 0 < remove < d:
            raise ValueError(f"remove must be in 1..{d - 1}, got {remove}")
        energy = pca_energy(C, remove)
    if not energy > 0:
        raise ValueError(f"the removed energy must be positive, got {energy}")
    return energy


# --- the command ---------------------------------------------------------------------------


def check_recipe(
    recipe: Recipe, registry: PluginRegistry, site: str, directions: int, output: Path, progress: Progress | None = None
) -> dict[str, Any]:
    """`compress surrogate`: the check at `site` with `directions` random directions (plus the
    structured ones), the model, calibration data (C, H), evaluation data (measured KL), device,
    seed and H options all from the recipe, and the removed energy PCA's at the recipe's
    sparsity. Writes `surrogate.json` and `surrogate.png` into `output` (created; each written
    under a temporary name and renamed, so a failure leaves neither half-written, and removes
    the folder again if it made it) and returns the JSON. Everything that needs no weights is
    checked before anything is loaded."""
    started = time.perf_counter()
    if recipe.evaluation is None:
        raise UserError("the surrogate check measures KL on the recipe's evaluation data: add an evaluation section")
    if directions < 1:
        raise UserError(f"--directions must be at least 1, got {directions}")
    for section in ("depth", "heads", "target_decode"):
        if getattr(recipe, section) is not None:
            raise UserError(
                f"the surrogate check measures one site of the original model: remove {section} from the recipe"
            )
    checked = plan(recipe, registry)
    check_site(checked.layout.family, checked.layout.config.num_hidden_layers, site)
    width = checked.layout.config.hidden_size
    if checked.layout.kept is None:
        raise UserError(
            "the surrogate check fixes the removed energy at PCA's for one uniform width: give the "
            "recipe a sparsity (and no per-site allocation) instead of target_params"
        )
    remove = width - checked.layout.kept
    if remove < 1:
        raise UserError(
            f"sparsity {recipe.sparsity} removes no direction at width {width}; the check fixes the "
            f"removed energy at PCA's for the recipe's sparsity: set a sparsity above 0"
        )
    device = resolve_device(recipe.device)
    if device.type != "cpu" and recipe.sensitivity.recompute is False:
        raise UserError(
            "sensitivity.recompute: false keeps every layer's graph, and so every layer, on the device; "
            "it is for CPU runs: leave it unset (or true) on a GPU"
        )
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise UserError(f"output {output} exists and is not a folder; choose another --output")
    created = not output.exists()
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create the output folder {output}: {error.strerror or error}") from None
    options = SurrogateOptions(
        directions, remove, measuring=Measuring(device, recipe.sensitivity, recipe.seed, progress)
    )
    try:
        return _check_into(output, recipe, checked.layout.family, site, options, started)
    except BaseException:
        if created:
            try:
                output.rmdir()  # only if still empty: never anything this call did not write
            except OSError:
                pass
        raise


def _check_into(
    output: Path, recipe: Recipe, family: ModelFamily, site: str, options: SurrogateOptions, started: float
) -> dict[str, Any]:
    """Load, check and write the two files (each under a temporary name, then renamed)."""
    report = options.measuring.progress or (lambda *_: None)
    torch.manual_seed(recipe.seed)
    report("tokenising data", 0, 1)
    tokenizer = load_tokenizer(recipe.model)
    calibration = token_batches(recipe.calibration, tokenizer, "calibration")
    evaluation = token_batches(recipe.evaluation, tokenizer, "evaluation")
    report("loading model", 0, 1)
    model = load_model(dataclasses.replace(recipe.model, load="memory"))  # it runs the whole model
    result = surrogate_check(model, family, calibration, evaluation, site, options)
    result.settings.update(
        {
            "model": recipe.model.path,
            "model_dtype": recipe.model.dtype,
            "sparsity": recipe.sparsity,
            "device": str(options.measuring.device),
        }
    )
    result.timings["total_s"] = time.perf_counter() - started
    values = result.to_json()

    report("writing results", 0, 1)
    targets = [output / JSON_FILE, output / PLOT_FILE]
    partial = [target.with_name(f".{target.name}.partial") for target in targets]
    try:
        partial[0].write_text(json.dumps(values, indent=2) + "\n")
        result.plot(partial[1])
        for source, target in zip(partial, targets):
            os.replace(source, target)
    finally:
        for path in partial:
            path.unlink(missing_ok=True)
    return values
