"""Data-parallel calibration: two gloo processes choose what one process chooses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from compressor.engine.bases import load_bases
from compressor.engine.calibration import capture_layer_inputs
from compressor.engine.fisher import FisherCall, estimate_fisher
from compressor.engine.parallel import Ranks
from compressor.engine.pooling import PipelineStep
from compressor.engine.transforms import fuse_norms
from compressor.engine.walk import prune
from compressor.engine.walk_options import PruneResult, WalkOptions
from compressor.faults import KILL_RANK_VARIABLE, KILL_VARIABLE
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout
from compressor.recipe.sections.sensitivity import SensitivityOptions
from compressor.strategies.registry import PluginRegistry
from tests.conftest import ROOT, copy_model, random_batches, tiny_model, widths_for
from tests.run.test_cli import write_recipe

STRATEGIES = ("pca", "sensitivity")
FAMILY = "llama"


def _batches() -> list:
    return random_batches(128, count=5, batch=2, padded=True)  # 5 batches: shares of 3 and 2


def _prune(strategy: str) -> PruneResult:
    """The same tiny model, pruned to 40 of 64 dimensions with one strategy (C and H in float64)."""
    original = tiny_model(FAMILY)
    registry = PluginRegistry()
    step = registry.strategy(strategy)
    return prune(
        copy_model(original),
        fixed_layout(original.config, family_for(FAMILY), widths_for(FAMILY, original.config, 40, slice_head=True)),
        _batches(),
        [PipelineStep(step, step.parse_options({}))],
        WalkOptions(sensitivity=SensitivityOptions(dtype="float64")),
    )


def _logits(result: PruneResult) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat(
            [result.model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits for b in _batches()]
        )


def _worker(rank: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    try:
        for strategy in STRATEGIES:
            result = _prune(strategy)
            tensors = {f"basis.{site}": basis for site, basis in result.bases.items()}
            tensors["logits"] = _logits(result)
            if result.fisher is not None:
                tensors.update({f"H.{site}": H for site, H in result.fisher.items()})
            save_file({k: v.contiguous() for k, v in tensors.items()}, f"{folder}/{strategy}.rank{rank}.safetensors")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ranks")
    mp.spawn(_worker, args=(2, str(folder)), nprocs=2, join=True)
    return folder


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_processes_choose_the_bases_one_process_chooses(two_ranks: Path, strategy: str) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: the same kernels, so each batch's statistics are the same bits
    try:
        single = _prune(strategy)
        expected_logits = _logits(single)
    finally:
        torch.set_num_threads(threads)
    ranks = [load_file(two_ranks / f"{strategy}.rank{rank}.safetensors") for rank in range(2)]
    for site, basis in single.bases.items():
        for saved in ranks:
            shared = saved[f"basis.{site}"]
            assert shared.shape == basis.shape
            assert torch.dist(shared @ shared.T, basis @ basis.T) <= 1e-10, site  # float64 round-off
        assert torch.equal(ranks[0][f"basis.{site}"], ranks[1][f"basis.{site}"]), site  # every rank the same
        if single.fisher is not None:
            H = single.fisher[site]
            assert torch.allclose(ranks[0][f"H.{site}"], H, rtol=1e-12, atol=1e-14 * H.abs().max()), site
    error = (ranks[0]["logits"] - expected_logits).abs().max() / expected_logits.abs().max()
    assert error <= 1e-6  # the pruned models are float32


def test_each_rank_gets_the_labels_a_single_process_draws_for_its_batches() -> None:
    """H of rank 0's and rank 1's batches (no communication), weighted by their token counts,
    adds up to H of all batches: skipping the other ranks' label draws keeps every batch's labels."""
    model = tiny_model(FAMILY)
    family = family_for(FAMILY)
    fuse_norms(model, family)
    batches = _batches()
    options = SensitivityOptions(dtype="float64")
    inputs = capture_layer_inputs(model, family, batches, torch.device("cpu"))
    whole = estimate_fisher(model, family, inputs, options, torch.device("cpu"), seed=3)
    parts, counts = [], []
    for rank in range(2):
        mine = Ranks(rank, 2).mine(len(batches))
        skipped = Ranks(rank, 2).skipped_rows([batch.input_ids.numel() for batch in batches])
        local = capture_layer_inputs(model, family, [batches[i] for i in mine], torch.device("cpu"))
        parts.append(
            estimate_fisher(model, family, local, options, torch.device("cpu"), 3, FisherCall(skipped=skipped))
        )
        counts.append(sum(local.sensitivity_counts))
    for site, H in whole.items():
        combined = (parts[0][site] * counts[0] + parts[1][site] * counts[1]) / sum(counts)
        assert torch.allclose(combined, H, rtol=1e-10, atol=1e-13 * H.abs().max()), site
    unskipped = estimate_fisher(
        model,
        family,
        capture_layer_inputs(model, family, batches[1::2], torch.device("cpu")),
        options,
        torch.device("cpu"),
        seed=3,
    )
    assert not torch.allclose(unskipped["embedding"], parts[1]["embedding"])  # the skips matter


def test_a_rank_without_a_batch_is_refused() -> None:
    original = tiny_model(FAMILY)
    with pytest.raises(Exception, match="at least one batch per process"):
        prune(
            copy_model(original),
            fixed_layout(original.config, family_for(FAMILY), widths_for(FAMILY, original.config, 40, slice_head=True)),
            random_batches(128, count=1),
            [PipelineStep(PluginRegistry().strategy("pca"))],
            WalkOptions(ranks=Ranks(1, 2)),
        )


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _compress(command: list[str], recipe: Path, output: Path, **kill: str) -> subprocess.CompletedProcess:
    """`compress run` (single or under torchrun); `kill`: fault variables (`compressor.faults`)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # torchrun's default, for both runs
    env.pop(KILL_VARIABLE, None)
    env.pop(KILL_RANK_VARIABLE, None)
    env.update(kill)
    return subprocess.run(
        [*command, "-m", "compressor.cli", "run", str(recipe), "--output", str(output)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _alone_and_shared(tmp_path: Path, tiny_checkpoint: Path, **changes: Any) -> tuple[dict, dict]:
    """The test recipe (sensitivity, six calibration windows, float64 H, plus `changes`) run by one
    process into tmp_path/single and by two under torchrun into tmp_path/two: both reports."""
    recipe = write_recipe(
        tmp_path,
        tiny_checkpoint,
        evaluation=None,
        pipeline=[{"strategy": "sensitivity"}],
        calibration__num_samples=6,
        sensitivity={"dtype": "float64"},
        **changes,
    )
    single = _compress([sys.executable], recipe, tmp_path / "single")
    assert single.returncode == 0, single.stderr
    shared = _compress(TORCHRUN, recipe, tmp_path / "two")
    assert shared.returncode == 0, shared.stderr
    alone, two = (json.loads((tmp_path / name / "report.json").read_text()) for name in ("single", "two"))
    return alone, two


def test_compress_run_under_torchrun_writes_one_run_with_one_process_bases(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """`torchrun --nproc-per-node 2 -m compressor.cli run`: rank 0 writes the run, with the bases a
    single process chooses and each rank's share of the tokens in the report."""
    alone, report = _alone_and_shared(tmp_path, tiny_checkpoint)
    assert report["parallel"]["world_size"] == 2 and alone["parallel"]["world_size"] == 1
    assert report["parallel"]["tokens_by_rank"] == [4 * 64, 2 * 64]  # batches 0, 2 and 1 of three batches of 2
    assert sum(report["parallel"]["tokens_by_rank"]) == alone["parallel"]["tokens_by_rank"][0]
    expected, found = (
        load_bases(tmp_path / "single" / "bases.safetensors"),
        load_bases(tmp_path / "two" / "bases.safetensors"),
    )
    for site, V in expected.items():
        assert torch.dist(found[site] @ found[site].T, V @ V.T) <= 1e-10, site
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml", "single", "two"]  # no staging left behind


@pytest.mark.parametrize(("point", "loaded", "fisher_loaded"), [("fisher", 0, False), ("site:layers.0.attn", 2, True)])
def test_a_torchrun_job_that_lost_rank_0_resumes_to_the_same_run(
    point: str, loaded: int, fisher_loaded: bool, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """Rank 0 killed mid-way (in the H pass, or in the middle of a layer after a site's checkpoint):
    the job fails, nothing is published, and the same torchrun command continues from rank 0's
    checkpoint on every rank, to the bases of an uninterrupted two-process run, bit for bit."""
    recipe = write_recipe(
        tmp_path,
        tiny_checkpoint,
        evaluation=None,
        pipeline=[{"strategy": "sensitivity"}],
        calibration__num_samples=8,
        sensitivity={"chunk": 2},
    )
    whole = _compress(TORCHRUN, recipe, tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    killed = _compress(TORCHRUN, recipe, tmp_path / "run", **{KILL_VARIABLE: point, KILL_RANK_VARIABLE: "0"})
    assert killed.returncode != 0
    assert not (tmp_path / "run").exists() and (tmp_path / ".run.partial" / "checkpoint").is_dir()
    resumed = _compress(TORCHRUN, recipe, tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["resume"] == {"sites_loaded": loaded, "fisher_loaded": fisher_loaded}
    assert report["parallel"] == json.loads((tmp_path / "whole" / "report.json").read_text())["parallel"]
    expected, found = (
        load_bases(tmp_path / "whole" / "bases.safetensors"),
        load_bases(tmp_path / "run" / "bases.safetensors"),
    )
    assert expected.keys() == found.keys()
    assert all(torch.equal(found[site], V) for site, V in expected.items())
    assert not (tmp_path / ".run.partial").exists()


def test_refinement_across_processes_is_refused(tiny_checkpoint: Path, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None, refinement={"epochs": 1})
    done = _compress(TORCHRUN, recipe, tmp_path / "two")
    assert done.returncode != 0
    assert "refinement runs in one process" in done.stderr
    assert not (tmp_path / "two").exists()


@pytest.mark.slow  # two runs and a two-process torchrun job (~40 s); .ci/run runs it
@pytest.mark.parametrize("layout", ["global", "per_site"])
def test_the_mlp_stage_under_torchrun_keeps_what_one_process_keeps(
    layout: str, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """`mlp.kept` under torchrun: each rank measures its share of the batches, C is summed, and
    rank 0 saves the model one process saves (the same neurons, weights up to the sums' order),
    the MLP records counting every rank's tokens."""
    alone, report = _alone_and_shared(tmp_path, tiny_checkpoint, slicing={"layout": layout}, mlp={"kept": 0.5})
    assert report["parallel"]["world_size"] == 2 and report["mlp"]["weighed_by_h"]
    assert [r["tokens"] for r in report["mlp"]["layers"]] == [r["tokens"] for r in alone["mlp"]["layers"]]
    assert [r["error_refit"] for r in report["mlp"]["layers"]] == pytest.approx(
        [r["error_refit"] for r in alone["mlp"]["layers"]], rel=1e-6
    )
    expected, found = (load_file(tmp_path / name / "model" / "model.safetensors") for name in ("single", "two"))
    assert expected.keys() == found.keys()
    for name, tensor in expected.items():
        assert found[name].shape == tensor.shape, name
        assert torch.allclose(found[name], tensor, atol=1e-5, rtol=1e-4), name


def test_choosing_the_split_across_processes_is_refused(tiny_checkpoint: Path, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, tiny_checkpoint, evaluation=None, target_params=0.8, sparsity=None, mlp={})
    done = _compress(TORCHRUN, recipe, tmp_path / "two")
    assert done.returncode != 0  # torchrun's own code for a failed process
    assert "choosing the split of the budget runs in one process" in done.stderr
    assert not (tmp_path / "two").exists()


def _agreement_worker(rank: int, world: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    try:
        ranks = Ranks.current()
        same = ranks.agree(torch.tensor([3, 1, 4, 1, 5]))
        other = ranks.agree(torch.tensor([0, 3] if rank == 0 else [1, 2]))  # other neurons, the same plain sum
        (Path(folder) / f"rank{rank}.json").write_text(json.dumps([same, other]))
    finally:
        dist.destroy_process_group()


def test_ranks_agree_only_on_the_same_choice(tmp_path: Path) -> None:
    """The check the MLP stage makes after each rank chooses its neurons: the same sorted indices
    agree, other indices with the same plain sum do not."""
    mp.spawn(_agreement_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)] == [[True, False]] * 2
    assert Ranks().agree(torch.tensor([1, 2]))  # one process agrees with itself


@pytest.mark.slow
def test_torchrun_streams_the_weights_in_every_process(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """`model.load: stream` under torchrun: each process reads the layers it visits from the shards;
    the bases are those one process chooses (as in memory, above)."""
    alone, report = _alone_and_shared(tmp_path, tiny_checkpoint, model__load="stream")
    assert report["parallel"]["world_size"] == 2
    expected, found = (
        load_bases(tmp_path / "single" / "bases.safetensors"),
        load_bases(tmp_path / "two" / "bases.safetensors"),
    )
    for site, V in expected.items():
        assert torch.dist(found[site] @ found[site].T, V @ V.T) <= 1e-10, site
