"""Behaviour unchanged? A corpus of runs recorded before and after a change, and compared.

A refactor of the package (issue 80) must leave every run as it was: the same tensors, bit for bit,
the same report figures (timings aside), the same dry-run plans and the same refusal lines. This
script runs a fixed corpus through the `compress` command and records, per case, the exit code, the
lines that matter (a dry run's checks with times and memory sizes masked, an error's one line), a
SHA-256 of every tensor the run saved, the saved configs, and `report.json` without its timings.

    python benchmarks/behaviour.py record --out benchmarks/results/behaviour-before.json
    (change the code)
    python benchmarks/behaviour.py record --out benchmarks/results/behaviour-after.json
    python benchmarks/behaviour.py compare benchmarks/results/behaviour-before.json benchmarks/results/behaviour-after.json

The corpus: every shipped recipe's and sweep's `--dry-run`; on ref-llama (`../shared`, small
calibration and evaluation so the whole corpus takes minutes) the demo, a per-site sensitivity run,
refinement, a global `mlp: {}` run with its split chosen and distilled, the heterogeneous layout,
depth (a count given and one chosen), query heads, a run killed at a site and resumed, and the
shipped sweeps; an experts run on a small random Mixtral (identity of behaviour needs no trained
MoE); and the generated-recipe corpus (`tests/run/recipe_fuzz.py`) through `--dry-run`, each case's
exit code and line. `--only` picks cases by glob. `compare` prints a table (identical, or what
differs) and writes it as Markdown beside the second file.

Record both sides with the same `--work` folder, or one as long: the generated corpus cuts recipe
files at fixed bytes, and the files hold paths under it, so a longer folder moves the cuts (13 cases
then differ in their column or offset, not in behaviour).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

SHARED = ROOT.parent / "shared"
SMALL = (
    "calibration.num_samples=16",
    "calibration.seq_len=128",
    "evaluation.num_samples=8",
    "evaluation.seq_len=128",
    "evaluation.lm_eval=null",
    "evaluation.throughput=false",
    "threads=2",
)
"""Every run's calibration and evaluation made small: the corpus compares behaviour, not quality."""

SHORT_REFINEMENT = ("refinement.windows=8",)
SHORT_DISTILLATION = (
    "distillation.tokens=4096",
    "distillation.seq_len=128",
    "distillation.heldout_windows=4",
    "distillation.eval_every=4",
)
TIMING_KEYS = {
    "timings",
    "estimate",
    "load_average",
    "torch_threads",
    "started",
    "finished",
    "date",
    "threads",
    "seconds",
    "seconds_per_million_tokens",
    "peak_memory_bytes",
}
"""report.json keys whose values are measured times, memory or the machine's state, never compared."""

MASKED = re.compile(
    r"(\d[\d,]*(\.\d+)?\s*(ms|s|min|h|B|KiB|MiB|GiB|TiB|KB|MB|GB)\b\s*)+|"
    r"timed here in [\d.]+ s|load average [\d.]+|CPU threads: .*|keeps [\d.]+ of the \d+ CPUs|"
    r"\(the CPUs this process is given[^)]*\)"
)
"""Times, memory sizes and the machine's threads and load in printed lines: measured, not planned."""


@dataclass
class Case:
    """One `compress` invocation of the corpus (or a resumed pair, `kill`)."""

    name: str
    argv: list[str]
    output: bool = True
    """Whether the command writes a run (or sweep) folder whose files are recorded."""
    kill: str | None = None
    """A fault point the first attempt is killed at; the case records the second attempt."""
    env: dict[str, str] = field(default_factory=dict)


def _run_case(recipe: Path, *sets: str) -> list[str]:
    return ["run", str(recipe), *(f"--set={s}" for s in sets)]


def corpus(work: Path) -> list[Case]:
    """The cases, in the order they run (cheap checks first)."""
    recipes = ROOT / "recipes"
    cases = [
        Case(f"dry-run {p.name}", ["run", str(p), "--dry-run"], output=False) for p in sorted(recipes.glob("*.yaml"))
    ]
    cases += [
        Case(f"sweep dry-run {p.name}", ["sweep", str(p), "--dry-run"], output=False)
        for p in sorted((recipes / "sweeps").glob("*.yaml"))
    ]
    if not (SHARED / "models" / "ref-llama").is_dir():
        return cases
    sens, stock = recipes / "ref_llama_sens.yaml", recipes / "ref_llama_stock.yaml"
    plain_stock = (*SMALL, "sparsity=null", "target_params=0.75", "refinement=null", "distillation=null")
    cases += [
        Case("run demo", _run_case(recipes / "demo.yaml", *SMALL)),
        Case("run sensitivity per-site", _run_case(sens, *SMALL)),
        Case("run refinement", _run_case(recipes / "ref_llama_beyond.yaml", *SMALL, *SHORT_REFINEMENT)),
        Case(
            "run global mlp split distilled",
            _run_case(stock, *SMALL, *SHORT_REFINEMENT, *SHORT_DISTILLATION, "sparsity=null", "target_params=0.75"),
        ),
        Case("run global mlp kept", _run_case(stock, *plain_stock, "mlp.kept=512")),
        Case("run heterogeneous", _run_case(stock, *plain_stock, "slicing.layout=heterogeneous", "mlp.round_to=128")),
        Case("run depth removed", _run_case(stock, *plain_stock, "mlp=null", "depth={removed: 1}")),
        Case("run depth chosen", _run_case(stock, *plain_stock, "mlp=null", "depth={max_removed: 2}")),
        Case("run heads", _run_case(stock, *plain_stock, "mlp=null", "heads={kept: 0.5}")),
        Case("run killed and resumed", _run_case(sens, *SMALL), kill="site:layers.2.mlp"),
    ]
    moe = work / "tiny-mixtral"
    cases.append(
        Case(
            "run experts (tiny mixtral)",
            _run_case(
                stock, *plain_stock, f"model.path={moe}", "mlp=null", "experts={kept: 2}", "slicing.layout=global"
            ),
        )
    )
    for sweep in ("ref_llama_axes", "ref_llama_split", "ref_llama_split_60", "ref_llama_strategies"):
        cases.append(Case(f"sweep {sweep}", ["sweep", str(work / "sweeps" / f"{sweep}.yaml")]))
    return cases


def prepare(work: Path) -> None:
    """What the corpus needs beside the checkout: the tiny Mixtral, and the shipped sweeps made small
    (their base given by absolute path, the small settings added to their `set`)."""
    import yaml

    from tests.conftest import save_tiny_checkpoint

    moe = work / "tiny-mixtral"
    if not (moe / "config.json").is_file():
        save_tiny_checkpoint(moe, "mixtral")
    (work / "sweeps").mkdir(parents=True, exist_ok=True)
    for path in sorted((ROOT / "recipes" / "sweeps").glob("*.yaml")):
        sweep = yaml.safe_load(path.read_text())
        sweep["base"] = str((path.parent / sweep["base"]).resolve())
        sweep["output"] = str(work / "sweep-runs" / path.stem)
        extra = dict(s.split("=", 1) for s in SMALL)  # threads too: a sweep's sums depend on them
        sweep["set"] = {**sweep.get("set", {}), **{k: yaml.safe_load(v) for k, v in extra.items()}}
        (work / "sweeps" / path.name).write_text(yaml.safe_dump(sweep, sort_keys=False))


def masked(text: str) -> list[str]:
    """A command's printed lines worth comparing: checks, notes, errors and warnings, with measured
    figures masked; progress bars and tables dropped."""
    keep = []
    for line in text.splitlines():
        stripped = line.strip()
        if re.match(r"^(checked|not checked|note|error|warning|recipe|would run|\d+ runs?|the runs)", stripped):
            keep.append(MASKED.sub("<measured>", stripped))
    return keep


def scrubbed(value: Any) -> Any:
    """report.json without what is measured rather than computed (times, the machine's load)."""
    if isinstance(value, dict):
        return {
            k: scrubbed(v)
            for k, v in value.items()
            if k not in TIMING_KEYS and not k.endswith("_s") and not k.endswith("_seconds") and k != "speed"
        }
    if isinstance(value, list):
        return [scrubbed(v) for v in value]
    return value


def tensor_hashes(folder: Path) -> dict[str, str]:
    """SHA-256 of every tensor in every safetensors file under `folder`, by file and tensor name."""
    from safetensors import safe_open

    found = {}
    for path in sorted(folder.rglob("*.safetensors")):
        if "checkpoint" in path.relative_to(folder).parts:
            continue
        with safe_open(str(path), framework="pt") as handle:
            for name in sorted(handle.keys()):
                tensor = handle.get_tensor(name).contiguous()
                raw = tensor.view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes()
                found[f"{path.relative_to(folder)}:{name}"] = hashlib.sha256(raw).hexdigest()[:16]
    return found


def folder_record(folder: Path) -> dict[str, Any]:
    """A finished run (or sweep) folder: its tensors' hashes, saved configs and scrubbed reports."""
    record: dict[str, Any] = {"tensors": tensor_hashes(folder), "configs": {}, "reports": {}, "files": []}
    for path in sorted(folder.rglob("*")):
        relative = str(path.relative_to(folder))
        if path.is_dir() or "checkpoint" in path.relative_to(folder).parts:
            continue
        record["files"].append(relative)
        if path.name == "config.json":
            record["configs"][relative] = json.loads(path.read_text())
        elif path.name == "report.json":
            record["reports"][relative] = scrubbed(json.loads(path.read_text()))
    return record


def compress(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "compressor.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env}, cwd=ROOT)


def record_case(case: Case, work: Path) -> dict[str, Any]:
    """Run `case` (twice when it is killed first) and record what it did."""
    out = work / "out" / re.sub(r"[^\w.-]+", "-", case.name)
    shutil.rmtree(out, ignore_errors=True)
    if case.argv[0] == "sweep" and case.output:  # a sweep skips the runs it finds finished: start afresh
        shutil.rmtree(work / "sweep-runs" / Path(case.argv[1]).stem, ignore_errors=True)
    argv = list(case.argv)
    if case.output and argv[0] == "run":
        argv += ["--output", str(out)]
    entry: dict[str, Any] = {}
    if case.kill is not None:
        killed = compress(argv, {**case.env, "COMPRESS_KILL_AT": case.kill})
        entry["killed_exit"] = killed.returncode
    done = compress(argv, case.env)
    entry.update(exit=done.returncode, lines=masked(done.stdout + "\n" + done.stderr))
    if done.returncode != 0:
        entry["stderr_tail"] = done.stderr.strip().splitlines()[-3:]
    if case.output and done.returncode == 0:
        folder = out if argv[0] == "run" else work / "sweep-runs" / Path(argv[1]).stem
        entry.update(folder_record(folder))
    return placeless(entry, work)


def placeless(value: Any, work: Path) -> Any:
    """`value` with the checkout's and the work folder's paths named, not spelled: two checkouts
    (before and after) record the same."""
    text = json.dumps(value).replace(str(work), "<work>").replace(str(ROOT), "<root>")
    return json.loads(text)


@contextmanager
def captured_fds() -> Iterator[list[str]]:
    """Everything written to file descriptors 1 and 2 inside the block (rich, warnings, prints)."""
    result: list[str] = []
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile(mode="w+") as out, tempfile.TemporaryFile(mode="w+") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield result
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for f in saved:
                os.close(f)
            out.seek(0)
            err.seek(0)
            result += [out.read(), err.read()]


def record_fuzz(work: Path) -> dict[str, Any]:
    """The generated-recipe corpus through `--dry-run` in this process: each case's exit code and
    its error line (the case's folder replaced by `<case>`)."""
    from compressor.cli import main
    from tests.conftest import save_tiny_checkpoint
    from tests.run.test_generated_recipes import generated, small_data

    base = work / "fuzz"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    checkpoint = save_tiny_checkpoint(base / "tiny-llama")
    cases = generated(checkpoint, small_data(base))
    found: dict[str, Any] = {}
    for index, case in enumerate(cases):
        folder = base / str(index)
        folder.mkdir()
        model = folder / "model"
        if case.config is None:
            model.symlink_to(checkpoint)
        else:
            model.mkdir()
            for file in checkpoint.iterdir():
                if file.name != "config.json":
                    (model / file.name).symlink_to(file)
            config = case.config if isinstance(case.config, bytes) else json.dumps(case.config).encode()
            (model / "config.json").write_bytes(config)
        (folder / "recipe.yaml").write_bytes(case.text)
        arguments = ["run", str(folder / "recipe.yaml"), *(f"--set={o}" for o in case.overrides), "--dry-run"]
        with captured_fds() as streams:
            try:
                code: int | str = main(arguments)
            except BaseException as error:  # noqa: BLE001 (recorded: a crash is behaviour too)
                code = f"raised {type(error).__name__}"
        err = streams[1].replace(str(folder), "<case>").replace(str(base), "<fuzz>")
        error_lines = [MASKED.sub("<measured>", line) for line in err.splitlines() if line.startswith("error:")]
        found[f"{index:04d} {case.name}"] = {"exit": code, "error": error_lines}
    return found


def record(args: argparse.Namespace) -> None:
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    console = Console()
    prepare(work)
    cases = [c for c in corpus(work) if not args.only or any(fnmatch.fnmatch(c.name, p) for p in args.only)]
    results: dict[str, Any] = {"commit": _commit(), "cases": {}, "seconds": {}}
    for case in cases:
        start = time.perf_counter()
        console.print(f"[bold]{case.name}[/bold] ...", end=" ")
        results["cases"][case.name] = record_case(case, work)
        results["seconds"][case.name] = round(time.perf_counter() - start, 1)
        console.print(f"exit {results['cases'][case.name]['exit']} in {results['seconds'][case.name]} s")
    if not args.only or any(fnmatch.fnmatch("fuzz", p) for p in args.only):
        start = time.perf_counter()
        console.print("[bold]generated recipes[/bold] ...", end=" ")
        results["cases"]["generated recipes"] = record_fuzz(work)
        results["seconds"]["generated recipes"] = round(time.perf_counter() - start, 1)
        console.print(
            f"{len(results['cases']['generated recipes'])} cases in {results['seconds']['generated recipes']} s"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    console.print(f"wrote {args.out}")


def _commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "compressor", "plugins"], capture_output=True, text=True, cwd=ROOT
    )
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def differences(before: Any, after: Any, path: str = "") -> list[str]:
    """Where two records differ, as dotted paths (the first few values shown)."""
    if isinstance(before, dict) and isinstance(after, dict):
        found = []
        for key in sorted(set(before) | set(after)):
            if key not in after:
                found.append(f"{path}{key}: gone")
            elif key not in before:
                found.append(f"{path}{key}: new")
            else:
                found += differences(before[key], after[key], f"{path}{key}.")
        return found
    if before != after:
        return [f"{path.rstrip('.')}: {str(before)[:80]} -> {str(after)[:80]}"]
    return []


def normalised(value: Any, key: str = "") -> Any:
    """A record with today's masks applied again (lines, refusal lines) and measured keys dropped, so
    records written before a mask was added still compare."""
    if isinstance(value, dict):
        return {k: normalised(v, k) for k, v in value.items() if k not in TIMING_KEYS and k != "speed"}
    if isinstance(value, list):
        found = [normalised(v, key) for v in value]
        machine = r"^(run \d+/\d+ |warning: other work )"  # progress, and the load other work puts on the machine
        return [v for v in found if not re.match(machine, v)] if key == "lines" else found
    if isinstance(value, str) and key in ("lines", "error"):
        return re.sub(r"(<measured>\s*)+", "<measured> ", MASKED.sub("<measured>", value)).strip()
    return value


def compare(args: argparse.Namespace) -> int:
    before, after = (json.loads(Path(p).read_text()) for p in (args.before, args.after))
    before["cases"], after["cases"] = normalised(before["cases"]), normalised(after["cases"])
    table = Table(title=f"behaviour: {before['commit']} -> {after['commit']}")
    for column in ("case", "verdict", "tensors", "what differs"):
        table.add_column(column)
    rows, changed = [], 0
    names = list(before["cases"]) + [n for n in after["cases"] if n not in before["cases"]]
    for name in names:
        if name not in before["cases"] or name not in after["cases"]:
            rows.append((name, "only in one", "", ""))
            continue
        found = differences(before["cases"][name], after["cases"][name])
        tensors = before["cases"][name].get("tensors")
        count = (
            str(len(tensors))
            if tensors is not None
            else (str(len(before["cases"][name])) + " cases" if name == "generated recipes" else "")
        )
        changed += bool(found)
        rows.append(
            (
                name,
                "identical" if not found else "DIFFERS",
                count,
                "; ".join(found[:3]) + (f" (+{len(found) - 3})" if len(found) > 3 else ""),
            )
        )
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    markdown = ["| case | verdict | tensors | what differs |", "|---|---|---:|---|"]
    markdown += [f"| {' | '.join(row)} |" for row in rows]
    path = Path(args.after).with_suffix(".md")
    path.write_text(f"behaviour: {before['commit']} -> {after['commit']}\n\n" + "\n".join(markdown) + "\n")
    print(f"{len(rows) - changed} of {len(rows)} cases identical; table in {path}")
    return 1 if changed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="run the corpus and write its record")
    rec.add_argument("--out", required=True)
    rec.add_argument("--work", default=str(ROOT / "benchmarks" / "results" / "behaviour-work"))
    rec.add_argument("--only", nargs="*", help="case names (globs); 'fuzz' for the generated recipes")
    cmp = commands.add_parser("compare", help="compare two records")
    cmp.add_argument("before")
    cmp.add_argument("after")
    args = parser.parse_args()
    if args.command == "record":
        record(args)
        return 0
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
