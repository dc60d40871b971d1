"""Generated malformed recipes (hypothesis): whatever a script feeds `compress run`, the outcome
is exit code 0 or 2, one line on stderr for 2, never a traceback, and no output folder left
behind by a failure."""

from __future__ import annotations

import atexit
import contextlib
import copy
import io
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compressor.cli import main
from tests.conftest import EXAMPLES, save_tiny_checkpoint

CHECKPOINT = None


def _checkpoint() -> Path:
    """One tiny model for every example (hypothesis runs examples outside pytest's fixtures)."""
    global CHECKPOINT
    if CHECKPOINT is None:
        folder = tempfile.mkdtemp(prefix="fuzz-model-")
        atexit.register(shutil.rmtree, folder, True)
        CHECKPOINT = save_tiny_checkpoint(Path(folder))
    return CHECKPOINT


def _base() -> dict[str, Any]:
    data = {"path": "json", "data_files": str(EXAMPLES / "data" / "calib-demo.jsonl")}
    return {
        "model": {"path": str(_checkpoint()), "dtype": "float32"},
        "calibration": {"dataset": data, "num_samples": 4, "seq_len": 32, "batch_size": 2},
        "sparsity": 0.25,
        "pipeline": [{"strategy": "pca"}],
        "evaluation": {
            "dataset": dict(data, data_files=str(EXAMPLES / "data" / "valid-demo.jsonl")),
            "num_samples": 2,
            "seq_len": 32,
            "throughput": False,
        },
        "output": "out",
    }


KEYS = [
    "model",
    "model.path",
    "model.dtype",
    "model.revision",
    "model.attn_implementation",
    "calibration",
    "calibration.dataset",
    "calibration.dataset.path",
    "calibration.dataset.data_files",
    "calibration.num_samples",
    "calibration.seq_len",
    "calibration.batch_size",
    "calibration.format",
    "calibration.text_field",
    "calibration.messages_field",
    "sparsity",
    "target_params",
    "pipeline",
    "pipeline.0",
    "pipeline.0.strategy",
    "pipeline.0.taus",
    "pipeline.0.include_pca",
    "pipeline.0.refine",
    "pipeline.1",
    "pipeline.1.strategy",
    "pipeline.1.steps",
    "evaluation",
    "evaluation.num_samples",
    "evaluation.seq_len",
    "evaluation.lm_eval",
    "evaluation.lm_eval.tasks",
    "evaluation.lm_eval.limit",
    "evaluation.throughput",
    "slicing",
    "slicing.round_to",
    "slicing.slice_head",
    "slicing.tie_head",
    "slicing.shared_bases",
    "slicing.correct_readers",
    "allocation",
    "allocation.method",
    "allocation.min_kept",
    "allocation.step",
    "sensitivity",
    "sensitivity.chunk",
    "sensitivity.dtype",
    "sensitivity.reduction",
    "sensitivity.autocast",
    "sensitivity.recompute",
    "device",
    "seed",
    "activations",
    "refinement",
    "refinement.epochs",
    "refinement.lr",
    "refinement.windows",
    "refinement.top_k",
    "output",
    "bogus",
    "model.bogus",
    "slicing.bogus",
    "pipeline.0.bogus",
]

ODD_STRINGS = [
    "",
    " ",
    "pca",
    "sensitivity",
    "stiefel",
    "nope",
    "cuda:7",
    "cpu",
    "auto",
    "float16",
    "int8",
    "chat",
    "text",
    "curves",
    "uniform",
    "disk",
    "host",
    "/",
    "/dev/null",
    "/nonexistent/model",
    "../..",
    "~",
    "~/nothing",
    "*.jsonl",
    "a" * 300,
    "ünïcödé",
    "\x00",
    "$HOME",
    "org/model-that-is-not-here",
    "https://example.invalid/data.jsonl",
    str(EXAMPLES / "data" / "calib-demo.jsonl"),
]

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.sampled_from([0, 1, 2, 3, 7, 8, 31, 64, 127, 128, 129, 4096, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 0.25, 0.5, 0.99, 1.0, 1.5, -0.1, math.inf, math.nan, 1e-300]),
    st.sampled_from(ODD_STRINGS),
    st.text(max_size=12),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["path", "strategy", "tasks", "x", "0"]), inner, max_size=3),
    ),
    max_leaves=6,
)


def _set(recipe: Any, dotted: str, value: Any) -> Any:
    """`recipe` with `dotted` set to `value` where the path exists or can be made; else unchanged."""
    node = recipe
    *parents, last = dotted.split(".")
    for part in parents:
        if isinstance(node, dict):
            node = node.setdefault(part, {})
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return recipe
    if isinstance(node, dict):
        node[last] = value
    elif isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value
    return recipe


def _delete(recipe: Any, dotted: str) -> Any:
    node = recipe
    *parents, last = dotted.split(".")
    for part in parents:
        node = (
            node.get(part)
            if isinstance(node, dict)
            else (node[int(part)] if isinstance(node, list) and part.isdigit() and int(part) < len(node) else None)
        )
    if isinstance(node, dict):
        node.pop(last, None)
    elif isinstance(node, list) and last.isdigit() and int(last) < len(node):
        del node[int(last)]
    return recipe


MUTATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.sampled_from(KEYS), VALUES),
        st.tuples(st.just("delete"), st.sampled_from(KEYS), st.none()),
    ),
    min_size=1,
    max_size=4,
)

OVERRIDES = st.lists(
    st.one_of(
        st.builds(
            lambda k, v: f"{k}={v}",
            st.sampled_from(KEYS),
            st.sampled_from(
                [
                    "",
                    "0",
                    "1",
                    "-1",
                    "0.5",
                    "1.5",
                    "nan",
                    ".inf",
                    "null",
                    "true",
                    "[]",
                    "{}",
                    "[1, 2]",
                    "{a: 1}",
                    "pca",
                    "'",
                    "[",
                    "{",
                    ": :",
                    "sensitivity",
                    "x" * 50,
                ]
            ),
        ),
        st.sampled_from(
            [
                "=1",
                "sparsity",
                "sparsity==0.3",
                "pipeline.9.strategy=pca",
                "model.path.x=1",
                "calibration.num_samples.0=1",
                "pipeline.x=1",
                "..=1",
                "a..b=2",
            ]
        ),
    ),
    max_size=3,
)


def _text(recipe: Any, breakage: int) -> str:
    """The recipe as YAML; `breakage` > 0 cuts or garbles it (broken YAML, odd top-level types)."""
    text = yaml.safe_dump(recipe, allow_unicode=True)
    if breakage == 1:
        return text[: len(text) // 2] + "\n  - : [\n"
    if breakage == 2:
        return text.replace(":", "", 1)
    if breakage == 3:
        return "- just\n- a list\n"
    if breakage == 4:
        return "\t" + text
    if breakage == 5:
        return ""
    if breakage == 6:
        return "!!python/object/apply:os.system ['echo unsafe']\n"
    return text


def _outcome(folder: Path, text: str, overrides: list[str], dry_run: bool) -> tuple[int, str]:
    recipe = folder / "recipe.yaml"
    recipe.write_text(text)
    arguments = ["run", str(recipe), *(a for o in overrides for a in ("--set", o))]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([*arguments, "--dry-run"] if dry_run else arguments)
    return code, err.getvalue()


def _check(folder: Path, code: int, err: str) -> None:
    assert "Traceback" not in err, err
    assert code in (0, 2), (code, err)
    if code == 2:
        assert err.count("\n") == 1 and err.startswith("error: "), err
        leftovers = sorted(p.name for p in folder.iterdir() if p.name != "recipe.yaml")
        assert not leftovers, (leftovers, err)


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
@given(mutations=MUTATIONS, overrides=OVERRIDES, breakage=st.sampled_from([0] * 10 + [1, 2, 3, 4, 5, 6]))
def test_generated_bad_recipes_end_in_one_line_and_leave_nothing(
    mutations: list, overrides: list[str], breakage: int
) -> None:
    recipe = _base()
    for kind, key, value in mutations:
        recipe = _set(recipe, key, copy.deepcopy(value)) if kind == "set" else _delete(recipe, key)
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        code, err = _outcome(folder, _text(recipe, breakage), overrides, dry_run=True)
        _check(folder, code, err)
        assert not (folder / "out").exists()  # a dry run writes nothing


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
@given(mutations=MUTATIONS, overrides=OVERRIDES)
def test_generated_bad_recipes_that_run_end_in_one_line_and_leave_nothing(
    mutations: list, overrides: list[str]
) -> None:
    recipe = _base()
    for kind, key, value in mutations:
        recipe = _set(recipe, key, copy.deepcopy(value)) if kind == "set" else _delete(recipe, key)
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        code, err = _outcome(folder, _text(recipe, 0), overrides, dry_run=False)
        _check(folder, code, err)
