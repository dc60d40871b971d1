"""What choosing the split of the budget costs (issue 49, item 4: at most 1.5x the chosen split's
own pruning), and what it chooses: one recipe with `mlp: {}` run three ways, each a
`compress run`:

- "every window, survey per split": every split pruned on every calibration window, each walk
  surveying the original model itself (the choice before `engine.walk.SurveyMemo`; the memo is
  switched off in that process only);
- "every window": the same, one survey for all the splits (the default);
- "screened on N windows" (`mlp.screen_windows: N`): each split pruned on N calibration windows,
  the chosen one then on all of them;
- "the N predicted best" (`--rows best`, `mlp.measure_best: N`): every split's KL predicted first,
  only the N best predicted pruned and measured (`--rows best-screened`: also screened).

The cost ratio compares the phase that differs: the time spent choosing beyond the chosen
split's own pruning, over that pruning (with `depth: {}`, choosing each count's blocks counts as
choosing). With every window the chosen split's trial is the run's
(its pruning is within `split_s`): (split_s − its prune_s) / its prune_s. Screened, the run prunes
the chosen split after choosing: split_s / (the run's prune_s + mlp_s). H is outside both (the
shared pass, `fisher_s`), as in every prune time of docs/benchmarks.md.

    python benchmarks/split_cost.py                         # ref-llama at target_params 0.75
    python benchmarks/split_cost.py --target 0.6 --screen 16 32
    python benchmarks/split_cost.py --rows every best best-screened --best 2 --screen 32
    python benchmarks/split_cost.py --rows every best --set 'heads={}' --label=-heads
    python benchmarks/split_cost.py --rows every best --set 'depth={}' --label=-depth   # block counts too

Writes benchmarks/results/split_cost_<name>.json and .md.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from axis_runs import EVALUATION, ROOT, common, run_report, write_tables
from rich.console import Console

WITHOUT_MEMO = (
    "import sys; from compressor.engine import walk; walk.SurveyMemo.recall = lambda self, key: None; "
    "from compressor.cli import main; raise SystemExit(main(sys.argv[1:]))"
)
"""A `compress` whose walks never recall a kept survey: each split surveys the original itself."""


def figures(report: dict[str, Any]) -> dict[str, Any]:
    """The choice, its held-out KL while choosing, and the cost ratio (module docstring)."""
    split, timings = report["mlp"]["split"], report["timings"]
    chosen = split["candidates"][split["chosen"]]
    if split.get("screen_windows") is None:
        own = chosen["prune_s"]
        beyond = timings["split_s"] - own
    else:
        own = timings["prune_s"] + timings.get("mlp_s", 0.0)
        beyond = timings["split_s"]
    open_depth = report.get("depth", {}).get("candidates") is not None
    if open_depth:  # `depth: {}`: choosing each count's blocks is part of choosing
        beyond += timings.get("depth_s", 0.0)
    blocks = chosen.get("removed_blocks") or []
    return {
        "chosen": f"{chosen['width']} / {chosen['mlp_kept']}"
        + (f" / {chosen['heads']} heads" if chosen.get("heads") else "")
        + (f" / without {', '.join(map(str, blocks))}" if blocks else ""),
        "choice_kl": chosen["heldout_kl"],
        "candidates": [
            {
                k: c.get(k)
                for k in ("width", "mlp_kept", "heads", "removed_blocks", "heldout_kl", "predicted_kl", "prune_s")
            }
            for c in split["candidates"]
        ],
        "depth_s": timings.get("depth_s") if open_depth else None,
        "predict_s": split.get("predict_s"),
        "split_s": timings["split_s"],
        "own_s": own,
        "ratio": beyond / own,
        "survey_passes": split.get("survey_passes"),
    }


def cells(row: dict[str, Any]) -> list[str]:
    return [
        row["label"],
        row["chosen"],
        f"{row['share']:.1%}",
        f"{row['kl']:.5f}",
        f"{row['ppl']:.3f}",
        f"{row['split_s']:.1f}",
        f"{row['own_s']:.1f}",
        f"{row['ratio']:.2f}x",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "ref_llama_stock.yaml")
    parser.add_argument("--target", type=float, default=0.75)
    parser.add_argument("--screen", type=int, nargs="+", default=[32], help="mlp.screen_windows values")
    parser.add_argument("--best", type=int, nargs="+", default=[2], help="mlp.measure_best values")
    parser.add_argument(
        "--rows",
        nargs="+",
        choices=["before", "every", "screen", "best", "best-screened"],
        default=["before", "every", "screen"],
        help="the configurations run (module docstring)",
    )
    parser.add_argument("--name", default="ref-llama")
    parser.add_argument("--label", default="", help="a suffix for the result files")
    parser.add_argument("--set", action="append", default=[], help="another recipe change for every row (heads={})")
    args = parser.parse_args()
    base = [
        f"target_params={args.target}",
        "sparsity=null",
        "refinement=null",
        "distillation=null",
        "pipeline=[{strategy: sensitivity, include_pca: true}]",
        "mlp={}",
        "mlp.measure_best=null",  # every row says what it predicts and screens (the defaults are auto)
        "mlp.screen_windows=null",
        *EVALUATION,
        *args.set,
    ]
    kinds = {
        "before": [("every window, survey per split", [], False)],
        "every": [("every window", [], True)],
        "screen": [(f"screened on {n} windows", [f"mlp.screen_windows={n}"], True) for n in args.screen],
        "best": [(f"the {b} predicted best", [f"mlp.measure_best={b}"], True) for b in args.best],
        "best-screened": [
            (
                f"the {b} predicted best, screened on {n} windows",
                [f"mlp.measure_best={b}", f"mlp.screen_windows={n}"],
                True,
            )
            for b in args.best
            for n in args.screen
        ],
    }
    configurations = [configuration for kind in args.rows for configuration in kinds[kind]]
    console, rows = Console(), []
    with tempfile.TemporaryDirectory() as scratch:
        for index, (label, changes, memo) in enumerate(configurations):
            console.print(f"[{index + 1}/{len(configurations)}] {label}")
            entry = ("-m", "compressor.cli") if memo else ("-c", WITHOUT_MEMO)
            report = run_report(args.recipe, [*base, *changes], Path(scratch) / "out", entry)
            rows.append({"label": label, "changes": changes, **common(report), **figures(report)})
    columns = ("choosing", "width / MLP", "params", "KL", "ppl", "choosing s", "chosen's pruning s", "beyond / own")
    title = f"{args.name} at target_params {args.target}: what choosing the split costs"
    write_tables(rows, columns, cells, title, f"split_cost_{args.name}_{args.target}{args.label}", args.recipe, console)


if __name__ == "__main__":
    main()
