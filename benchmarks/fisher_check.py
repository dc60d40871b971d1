"""Does H predict the output KL of a residual-stream perturbation? (the paper's Figure 2a check)

At one site of the reference model, for many k-dimensional subspaces U (k = 25% of the width:
random ones, and the bottom eigenspaces of τC + H/τ for τ from 0.01 to 100, which run from
H-aware to PCA), the stream is perturbed by δ = −α·UUᵀx at every token, with α chosen so the
activation energy removed equals PCA's at 25%. The local model predicts
KL ≈ ½·α²·Tr(UᵀCU·UᵀHU) (token-separable, shared H); the measured KL is the mean per-token
KL(original ‖ perturbed) on held-out windows. A strong rank correlation says H ranks directions
by their effect on the output, which activation energy alone (equal for every U here) cannot.

    .venv/bin/python benchmarks/fisher_check.py [--site layers.2.attn] [--out benchmarks/results/fisher_check.json]
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import compressor  # noqa: E402,F401
from compressor.calibration import LayerInputs, SecondMoment, capture_layer_inputs  # noqa: E402
from compressor.data import batches_of, load_records, token_windows  # noqa: E402
from compressor.families import family_for  # noqa: E402
from compressor.sensitivity import SensitivityOptions, estimate_fisher, site_activations  # noqa: E402
from compressor.sites import site_ids  # noqa: E402
from compressor.strategy import coupled_loss, eigh_descending  # noqa: E402
from compressor.transforms import fuse_norms  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"


def _inputs(model: Any, family: Any, tokenizer: Any, file: str, windows: int) -> LayerInputs:
    ids = token_windows(load_records({"path": "json", "data_files": str(SHARED / "corpus" / file)}),
                        tokenizer, 512, windows)
    return capture_layer_inputs(model, family, batches_of(ids, 8), torch.device("cpu"))


@torch.no_grad()
def _log_probs(model: Any, family: Any, inputs: LayerInputs, edit: Any = None) -> list[torch.Tensor]:
    return [torch.log_softmax(site_activations(model, family, inputs, b, edit)[1].float(), -1)
            for b in range(len(inputs))]


def _rank_correlation(a: list[float], b: list[float]) -> float:
    ra, rb = (torch.tensor(v).argsort().argsort().double() for v in (a, b))
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", default="layers.2.attn")
    parser.add_argument("--random", type=int, default=12, help="number of random subspaces")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fisher_check.json"))
    args = parser.parse_args()
    console = Console(width=140)
    path = SHARED / "models" / "ref-llama"
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    family = family_for("llama")
    fuse_norms(model, family)
    ids = site_ids(family, model.config.num_hidden_layers)
    if args.site not in ids:
        parser.error(f"--site must be one of {', '.join(ids)}")
    site = ids.index(args.site)

    calib = _inputs(model, family, tokenizer, "calib.jsonl", 64)
    H = estimate_fisher(model, family, calib, SensitivityOptions(), torch.device("cpu"))[args.site].double()
    moment = SecondMoment(H.shape[0], torch.device("cpu"))
    with torch.no_grad():
        for b in range(len(calib)):
            moment.add(site_activations(model, family, calib, b)[0][site], calib.token_masks[b])
    C = moment.value()
    d = C.shape[0]
    k = d - int(0.75 * d)

    valid = _inputs(model, family, tokenizer, "valid.jsonl", 16)
    reference = _log_probs(model, family, valid)
    _, pca_vectors = eigh_descending(C)
    target = torch.trace(pca_vectors[:, d - k:].T @ C @ pca_vectors[:, d - k:]).item()  # PCA's removed energy

    subspaces: list[tuple[str, torch.Tensor]] = []
    Cn, Hn = C / torch.linalg.matrix_norm(C), H / torch.linalg.matrix_norm(H)
    for tau in (0.01, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0):
        subspaces.append((f"bottom of τC+H/τ, τ={tau:g}", eigh_descending(tau * Cn + Hn / tau)[1][:, d - k:]))
    generator = torch.Generator().manual_seed(0)
    for i in range(args.random):
        subspaces.append((f"random {i}", torch.linalg.qr(torch.randn(d, k, generator=generator, dtype=torch.float64))[0]))

    rows = []
    for name, U in subspaces:
        energy = torch.trace(U.T @ C @ U).item()
        alpha = (target / energy) ** 0.5
        projector = (alpha * U @ U.T).float()
        edit = (lambda s, x: x - x @ projector if s == site else x)  # noqa: E731
        kl_sum, count = 0.0, 0
        for ref, new, mask in zip(reference, _log_probs(model, family, valid, edit), valid.token_masks):
            kl_sum += (ref.exp() * (ref - new)).sum(-1)[mask].double().sum().item()
            count += int(mask.sum())
        predicted = 0.5 * alpha ** 2 * coupled_loss(C, H, U)
        rows.append({"subspace": name, "alpha": alpha, "predicted_kl": predicted, "measured_kl": kl_sum / count})

    correlation = _rank_correlation([r["predicted_kl"] for r in rows], [r["measured_kl"] for r in rows])
    table = Table(title=f"H vs finite-difference KL at {args.site} (removed energy fixed at PCA's 25%)")
    for column in ("subspace", "α", "predicted KL", "measured KL"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["subspace"], f"{r['alpha']:.3f}", f"{r['predicted_kl']:.5f}", f"{r['measured_kl']:.5f}")
    console.print(table)
    console.print(f"Spearman rank correlation (predicted vs measured): {correlation:.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"site": args.site, "k": k, "rows": rows, "spearman": correlation}, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
