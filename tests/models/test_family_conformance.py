"""The family conformance suite: what every supported model family must pass, on a tiny random
model built from the family's own transformers config class (`tests/conftest.py`'s
`FAMILY_CONFIGS`: a few layers, GQA, non-trivial norm scales and biases, and each family's own
features: sliding and full layers, NoPE layers, multipliers, linear-attention layers).

Adding a family is its `ModelFamily` plus one line in `FAMILY_CONFIGS`; every check here, and
the per-family checks elsewhere (slicing shapes and exact parameter counts, saved bases, the H
pass, throughput), then run on it:

- a rotation without slicing reproduces the original logits to float32 round-off;
- a per-site run at sparsity 0.25 with the MLP's width pruned (`mlp: {kept: 0.75}`, each routed
  expert's in a Mixture-of-Experts model) saves a model
  that reloads with `import compressor`, and in an interpreter where compressor cannot be imported
  with `trust_remote_code=True`, computing the same logits bit for bit;
- `slicing.layout: global` saves the original class, which plain transformers (no compressor, no
  remote code) loads and which computes the sliced model's logits; where one basis cannot be the
  family's own class (norms after the blocks, LayerNorm), a global layout keeps the stream whole
  and prunes the MLP's width alone (`models.mlp_only`) to the most neurons the budget allows, and
  without an MLP width to prune the family's reason is refused in one line, exit 2, before work;
- (slow) a streamed run equals the in-memory run bit for bit, and a run killed with SIGKILL
  resumes to it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from compressor.cli import main
from compressor.engine.bases import apply_bases, load_bases
from compressor.engine.pooling import PipelineStep
from compressor.engine.walk import prune
from compressor.models.families import BUILTIN_FAMILIES, family_for, unfuse_experts
from compressor.models.layout import fixed_layout
from compressor.models.sites import layer_site_ids, site_ids
from compressor.models.stock import load_stock, save_stock, stock_param_model, to_stock
from compressor.strategies.contract import Strategy
from compressor_plugins.pca import PCA
from tests.conftest import (
    COMMON,
    FAMILY_CONFIGS,
    copy_model,
    max_relative_logit_error,
    random_batches,
    save_tiny_checkpoint,
    tiny_model,
    widths_for,
)
from tests.engine.test_equivalence import RandomRotation
from tests.run.test_cli import _DELETE, write_recipe
from tests.run.test_resume import compress, tensors

FAMILIES = sorted(FAMILY_CONFIGS)
STOCK_FAMILIES = sorted(t for f in BUILTIN_FAMILIES if f.stock_refusal is None for t in f.model_types)
NOT_STOCK = sorted(set(FAMILIES) - set(STOCK_FAMILIES))
MLP_ALONE = [name for name in NOT_STOCK if family_for(name).mlp_width is not None]
MLP_KEPT = 0.75  # of each MLP's neurons (96 of COMMON's 128; 24 of a tiny MoE's 32 per expert), rounded to 8

IDS = random_batches(8192, count=1, batch=2, length=16, padded=True)[0]

LOAD = """
import json, sys
if sys.argv[1] == "blocked":
    sys.modules["compressor"] = None  # importing compressor (or anything under it) now fails
else:
    import compressor  # noqa: F401
import torch
from transformers import AutoModelForCausalLM
ids, mask = (torch.tensor(rows) for rows in json.loads(sys.argv[2]))
remote = sys.argv[3] == "remote"
for folder in sys.argv[4:]:
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", trust_remote_code=remote
    ).eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    torch.save({"class": type(model).__name__, "logits": logits}, folder + f"/../logits-{sys.argv[1]}.pt")
"""


def _load_in_fresh_interpreters(folders: list[Path], remote: bool) -> None:
    """Each folder's logits on `IDS`, computed by a fresh interpreter with compressor blocked and by
    one with compressor imported, saved beside the folder (`logits-blocked.pt`, `logits-imported.pt`)."""
    ids = json.dumps([IDS.input_ids.tolist(), IDS.attention_mask.tolist()])
    for mode in ("blocked", "imported"):
        done = subprocess.run(
            [sys.executable, "-c", LOAD, mode, ids, "remote" if remote else "plain", *map(str, folders)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("strategy", [PCA(), RandomRotation()], ids=["pca", "random"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("family_name", FAMILIES)
def test_rotation_without_slicing_reproduces_logits(family_name: str, padded: bool, strategy: Strategy) -> None:
    original = tiny_model(family_name)
    batches = random_batches(original.config.vocab_size, padded=padded)
    d = original.config.hidden_size
    result = prune(
        copy_model(original),
        fixed_layout(
            original.config, family_for(family_name), widths_for(family_name, original.config, d, slice_head=True)
        ),
        batches,
        [PipelineStep(strategy)],
    )
    assert max_relative_logit_error(original, result.model, batches) <= 1e-4


EAGER = {"model__attn_implementation": "eager"}  # every family has it (Gemma 2 has no sdpa), as the loads here


def _mlp(name: str) -> dict:
    """The MLP's width pruned too, where the family describes it (GPT-2 does not)."""
    return {"mlp": {"kept": MLP_KEPT}} if family_for(name).mlp_width is not None else {}


def _slice_head(name: str) -> dict:
    return {"slice_head": True} if family_for(name).head_width_is_embedding_width else {}


def _run_each(root: Path, names: list[str], changes: Callable[[str], dict]) -> dict[str, Path]:
    """`compress run` of the test recipe with `changes(name)` on a tiny checkpoint of each family."""
    runs = {}
    for name in names:
        folder = root / name
        folder.mkdir()
        checkpoint = save_tiny_checkpoint(folder / "original", name)
        recipe = write_recipe(folder, checkpoint, output=str(folder / "run"), **EAGER, **changes(name))
        assert main(["run", str(recipe)]) == 0
        runs[name] = folder / "run"
    return runs


@pytest.fixture(scope="module")
def per_site_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A per-site PCA run at sparsity 0.25 with the MLP's width pruned, on every family, and each
    saved folder's logits from fresh interpreters (`trust_remote_code=True`)."""
    runs = _run_each(
        tmp_path_factory.mktemp("per-site"), FAMILIES, lambda name: {"slicing": _slice_head(name), **_mlp(name)}
    )
    _load_in_fresh_interpreters([run / "model" for run in runs.values()], remote=True)
    return runs


@pytest.mark.parametrize("name", FAMILIES)
def test_a_per_site_run_reloads_with_compressor_and_with_remote_code_alone(
    name: str, per_site_runs: dict[str, Path]
) -> None:
    run = per_site_runs[name]
    config = json.loads((run / "model" / "config.json").read_text())
    assert config["model_type"] == f"sliced_{name}"
    assert config["slicing"]["embedding"] == 48 and config["slicing"]["attn"][0] == 48
    if _mlp(name):
        width = json.loads((run.parent / "original" / "config.json").read_text())[family_for(name).mlp_width]
        assert config[family_for(name).mlp_width] == int(MLP_KEPT * width) // 8 * 8
    assert (run / "model" / "modeling_sliced.py").is_file()
    report = json.loads((run / "report.json").read_text())
    assert report["metrics"]["pruned"]["kl"] > 0  # slicing and the MLP stage changed the model
    # in this process (compressor imported), as the report's evaluation loaded it
    model = AutoModelForCausalLM.from_pretrained(run / "model", dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        expected = model(input_ids=IDS.input_ids, attention_mask=IDS.attention_mask).logits
    for mode in ("blocked", "imported"):  # the folder's own code, with and without compressor installed
        saved = torch.load(run / f"logits-{mode}.pt")
        assert saved["class"] == type(model).__name__
        assert torch.equal(saved["logits"], expected), mode


@pytest.fixture(scope="module")
def global_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A global-layout PCA run at sparsity 0.25 on every family whose class can hold one basis (heads
    untied, so the saved model computes exactly what the sliced one does), and the logits of each
    saved folder as plain transformers computes them where compressor cannot be imported."""
    global_layout = {"slicing": {"layout": "global", "tie_head": False}}
    runs = _run_each(tmp_path_factory.mktemp("global"), STOCK_FAMILIES, lambda name: global_layout)
    _load_in_fresh_interpreters([run / "model" for run in runs.values()], remote=False)
    return runs


@pytest.mark.parametrize("name", STOCK_FAMILIES)
def test_a_global_run_saves_a_stock_model_that_computes_the_pruned_model(
    name: str, global_runs: dict[str, Path]
) -> None:
    run = global_runs[name]
    config = json.loads((run / "model" / "config.json").read_text())
    original = json.loads((run.parent / "original" / "config.json").read_text())
    assert config["model_type"] == original["model_type"] and "auto_map" not in config
    assert config["architectures"] == original["architectures"]
    assert not list((run / "model").glob("*.py"))
    assert config["hidden_size"] < original["hidden_size"] and config["head_dim"] == 16
    family = family_for(name)
    assert config[family.norm_eps] == original[family.norm_eps]  # the stream is scaled instead
    saved = torch.load(run / "logits-blocked.pt")
    assert saved["class"] == original["architectures"][0]
    # The pruned model as compressor's sliced class computes it, rebuilt from the run's bases.
    bases = load_bases(run / "bases.safetensors")
    assert len({tuple(v.shape) for v in bases.values()}) == 1
    assert all(torch.equal(v, bases["embedding"]) for v in bases.values())
    sliced = apply_bases(
        AutoModelForCausalLM.from_pretrained(run.parent / "original", dtype=torch.float32, attn_implementation="eager"),
        family,
        bases,
        keep_tied=False,
    )
    with torch.no_grad():
        expected = sliced(input_ids=IDS.input_ids, attention_mask=IDS.attention_mask).logits
    keep = IDS.attention_mask.bool()
    error = ((saved["logits"][keep] - expected[keep]).abs().max() / expected[keep].abs().max()).item()
    assert error < 1e-5  # float32 round-off


@pytest.mark.parametrize("name", STOCK_FAMILIES)
def test_a_global_run_meets_its_budget_exactly(name: str, global_runs: dict[str, Path]) -> None:
    report = json.loads((global_runs[name] / "report.json").read_text())
    rounding, budget = report["rounding"], report["allocation"]["budget"]
    params = stock_param_model(
        AutoConfig.from_pretrained(global_runs[name].parent / "original"), family_for(name), tied=False
    )
    assert report["layout"] == "global" and report["stock"]["hidden_size"] == rounding["width"]
    assert report["params"]["pruned"] == rounding["params"] == report["allocation"]["predicted_params"]
    assert rounding["params"] <= budget < params.count({s: rounding["width"] + 8 for s in params.sites})
    assert (
        rounding["unrounded_params"]
        <= budget
        < params.count({s: rounding["unrounded_width"] + 1 for s in params.sites})
    )
    assert rounding["width"] % 8 == 0 and rounding["unrounded_width"] >= rounding["width"]
    assert report["allocation"]["transition_params"] == 0
    # The same budget as SliceGPT's model at 25% (48 of 64 at every site, transitions counted) keeps more
    # width; an MoE's experts outweigh the transitions so far that the rounding to 8 takes the gain back.
    assert rounding["unrounded_width"] > 48
    assert rounding["width"] > 48 or family_for(name).prepare is unfuse_experts


@pytest.mark.parametrize("name", STOCK_FAMILIES)
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_with_nothing_sliced_the_stock_model_computes_the_original(name: str, tie: bool, tmp_path: Path) -> None:
    original = tiny_model(name)
    if tie and not original.config.tie_word_embeddings:
        pytest.skip("the original's head is untied")
    config = tiny_model(name).config
    family = family_for(name)
    d = config.hidden_size
    bases = {site: torch.eye(d, dtype=torch.float64) for site in site_ids(family, config.num_hidden_layers)}
    sliced = apply_bases(copy_model(original), family, bases, keep_tied=False)
    save_stock(sliced, family, config, tmp_path, tie=tie)
    stock = load_stock(tmp_path, sliced)
    assert type(stock) is type(original)
    assert stock.config.tie_word_embeddings == tie
    assert max_relative_logit_error(original, stock, random_batches(config.vocab_size, padded=True)) < 2e-6


@pytest.mark.parametrize("name", STOCK_FAMILIES)
def test_a_tied_stock_model_computes_the_sliced_embedding_as_its_head(name: str) -> None:
    """Below the full width (the stream scaled, the norms' weights √(d/k)) with the head tied through
    a diagonal D: the stock model computes E·V·diag(D)·n, the sliced model whose head is its own
    embedding times D (whatever the family does to its embedding or logits)."""
    original = tiny_model(name, tie_word_embeddings=True)
    family = family_for(name)
    config = original.config
    generator = torch.Generator().manual_seed(3)
    q, _ = torch.linalg.qr(
        torch.randn(config.hidden_size, config.hidden_size, generator=generator, dtype=torch.float64)
    )
    bases = {site: q[:, :40] for site in site_ids(family, config.num_hidden_layers)}
    sliced = apply_bases(copy_model(original), family, bases, keep_tied=False)
    scale = 0.5 + torch.rand(40, generator=generator, dtype=torch.float64)
    stock, record = to_stock(sliced, family, config, tie=True, scale=scale)
    assert stock.config.tie_word_embeddings and stock.config.hidden_size == 40
    assert record["stream_scale"] == pytest.approx((40 / config.hidden_size) ** 0.5)
    embedding = sliced.get_submodule(family.embedding).weight
    sliced.get_submodule(family.head).weight = torch.nn.Parameter(
        embedding * scale.to(embedding.dtype), requires_grad=False
    )
    assert max_relative_logit_error(sliced, stock, random_batches(config.vocab_size, padded=True)) < 1e-5


def test_eval_rebuilds_a_global_run_without_its_model_as_the_stock_class(
    global_runs: dict[str, Path], tmp_path: Path
) -> None:
    """A sweep keeps only bases: `compress eval` rebuilds the stock model (a tied original's head
    untied, as the run saved it) and reproduces the run's own figures."""
    run = tmp_path / "run"
    shutil.copytree(global_runs["qwen2"], run)
    shutil.rmtree(run / "model")
    assert main(["eval", str(run), "--no-throughput", "--output", str(tmp_path / "eval.json")]) == 0
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    ran = json.loads((run / "report.json").read_text())
    assert "rebuilt" in evaluated["target"]
    for key in ("ppl", "kl"):
        assert evaluated["metrics"]["pruned"][key] == pytest.approx(ran["metrics"]["pruned"][key], rel=1e-5)


@pytest.mark.parametrize("name", NOT_STOCK)
def test_families_the_stock_class_cannot_hold_are_refused_before_work(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Without an `mlp` section there is nothing a stock model of these families can prune."""
    checkpoint = tmp_path / "model"
    AutoConfig.for_model(**{**COMMON, **FAMILY_CONFIGS[name]}).save_pretrained(checkpoint)
    recipe = write_recipe(tmp_path, checkpoint, slicing={"layout": "global", "slice_head": True}, **EAGER)
    for args in (["--dry-run"], []):
        assert main(["run", str(recipe), *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and family_for(name).stock_refusal in err
        if name in MLP_ALONE:
            assert err.startswith(f"error: slicing.layout: global: a stock {name} keeps its residual stream whole")
            assert "so only the MLP's width can be pruned; add mlp: {} (or mlp.kept)" in err
        else:
            assert err.startswith("error: slicing.layout: global saves the original")
            assert f"model types that can: {', '.join(STOCK_FAMILIES)} (or use slicing.layout: per_site)" in err
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial*"))


MLP_TARGET = 0.98


@pytest.fixture(scope="module")
def mlp_alone_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A global-layout run at target_params 0.98 with `mlp: {}` on every family whose class cannot
    hold a rotated stream, and each saved folder's logits as plain transformers computes them where
    compressor cannot be imported."""
    changes = {"slicing": {"layout": "global"}, "sparsity": _DELETE, "target_params": MLP_TARGET, "mlp": {}}
    runs = _run_each(tmp_path_factory.mktemp("mlp-alone"), MLP_ALONE, lambda name: changes)
    _load_in_fresh_interpreters([run / "model" for run in runs.values()], remote=False)
    return runs


def _params_with_neurons(folder: Path, family_name: str, neurons: int) -> int:
    """Parameters of the original class with `neurons` in every MLP, counted on a model built from
    its config on the meta device (independently of compressor's own counts)."""
    config = AutoConfig.from_pretrained(folder)
    setattr(config, family_for(family_name).mlp_width, neurons)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", MLP_ALONE)
def test_a_global_run_of_a_family_whose_stream_stays_whole_prunes_its_mlps_into_a_stock_model(
    name: str, mlp_alone_runs: dict[str, Path]
) -> None:
    run, family = mlp_alone_runs[name], family_for(name)
    config = json.loads((run / "model" / "config.json").read_text())
    original = json.loads((run.parent / "original" / "config.json").read_text())
    assert config["model_type"] == original["model_type"] and "auto_map" not in config
    assert config["architectures"] == original["architectures"] and not list((run / "model").glob("*.py"))
    assert config["hidden_size"] == original["hidden_size"]
    # the most neurons (a multiple of mlp.round_to, 8) whose model fits the budget
    width = original[family.mlp_width]
    count = {m: _params_with_neurons(run.parent / "original", name, m) for m in range(8, width + 1, 8)}
    budget = int(MLP_TARGET * _params_with_neurons(run.parent / "original", name, width))
    kept = max(m for m, params in count.items() if params <= budget)
    assert config[family.mlp_width] == kept < width
    report = json.loads((run / "report.json").read_text())
    assert report["params"]["pruned"] == count[kept] == report["allocation"]["predicted_params"]
    assert report["allocation"]["budget"] == budget and report["mlp"]["kept"] == kept
    assert report["stock"]["residual"] == f"kept whole: {family.stock_refusal}" and report["sites"] == []
    assert report["metrics"]["pruned"]["kl"] > 0 and not (run / "bases.safetensors").exists()
    # plain transformers, compressor blocked, computes what the run evaluated (loaded back as users load it)
    saved = torch.load(run / "logits-blocked.pt")
    assert saved["class"] == original["architectures"][0]
    model = AutoModelForCausalLM.from_pretrained(run / "model", dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        expected = model(input_ids=IDS.input_ids, attention_mask=IDS.attention_mask).logits
    assert torch.equal(saved["logits"], expected)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_a_streamed_run_and_a_killed_run_give_the_run_in_memory(name: str, tmp_path: Path) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / "original", name)
    recipe = write_recipe(
        tmp_path,
        checkpoint,
        slicing=_slice_head(name),
        evaluation=None,
        output=str(tmp_path / "run"),
        **EAGER,
    )
    runs = {}
    streams = family_for(name).prepare is None  # GPT-2's Conv1D rewrite is not done layer by layer yet
    for label, extra, kill in (
        ("memory", (), None),
        ("stream", ("--set", "model.load=stream"), None),
        ("killed", (), f"site:{layer_site_ids(family_for(name), 0)[-1]}"),  # mid-walk (Phi-2: one site a layer)
    ):
        output = tmp_path / label
        done = compress(recipe, output, *extra, kill=kill)
        if label == "stream" and not streams:  # refused before work, in one line
            assert done.returncode == 2 and done.stderr.count("\n") == 1 and "set model.load: memory" in done.stderr
            assert not output.exists()
            continue
        if kill is not None:
            assert done.returncode == -9, done.stderr
            done = compress(recipe, output)
        assert done.returncode == 0, done.stderr
        runs[label] = tensors(output)
    for label in ("stream", "killed") if streams else ("killed",):
        assert runs[label].keys() == runs["memory"].keys()
        assert not [k for k, v in runs["memory"].items() if not torch.equal(runs[label][k], v)], label


@pytest.mark.parametrize("name", FAMILIES)
def test_the_time_plan_times_one_layer_of_every_family(name: str) -> None:
    """`plan.timing.layer_costs` builds one real decoder layer of the family's shape (a small
    vocabulary, the head timed apart) and times its forward, backward and a single-token call."""
    from compressor.plan.timing import layer_costs

    config = AutoConfig.for_model(**{**COMMON, **FAMILY_CONFIGS[name]})
    text = getattr(config, "text_config", None) if name in ("gemma3", "mistral3", "qwen3_5") else None
    config = text or config
    forward, backward, call = layer_costs(
        config, family_for(config.model_type), torch.float32, "eager", torch.device("cpu"), 16
    )
    assert 0 < forward < backward * 10 and 0 < call < 10  # seconds: finite and positive (not their size)
