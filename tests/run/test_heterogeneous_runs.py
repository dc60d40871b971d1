"""`slicing.layout: heterogeneous` (issue 49, item 3): the stream kept whole, each layer's MLP its
own width allocated by predicted error under the budget, saved as DeciLM with this project's own
code. Keeping every neuron gives the original's logits through the DeciLM class; a pruned run's
folder reloads with the widths its report names and the parameters it counts; what the layout
cannot run with is refused in one line with nothing written; a run killed in the MLP stage
resumes to the same model. With `mlp.remove_attention` an attention that writes little is removed
and its parameters go to the MLPs, within the same budget."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from compressor.cli import main
from compressor.evaluation.metrics import parameter_count
from tests.conftest import max_relative_logit_error, random_batches, save_tiny_checkpoint
from tests.run.test_cli import _DELETE, write_recipe


def _checkpoint(tmp_path: Path, name: str = "llama") -> Path:
    return save_tiny_checkpoint(tmp_path / name, name, intermediate_size=512, num_hidden_layers=3)


def _quiet_checkpoint(tmp_path: Path) -> Path:
    """A Llama wide enough that an attention is worth 256 neurons (hidden 256: 196,608 parameters
    against 768 per neuron), whose layer 1's attention writes almost nothing."""
    folder = save_tiny_checkpoint(
        tmp_path / "quiet", "llama", hidden_size=256, head_dim=64, intermediate_size=512, num_hidden_layers=3
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.model.layers[1].self_attn.o_proj.weight.data.mul_(1e-3)
    model.save_pretrained(folder)
    return folder


def _recipe(tmp_path: Path, checkpoint: Path, **changes) -> Path:
    settings = {"budget": "non_embedding", "target_params": 0.8, "mlp": {}, **changes}
    settings = {key: value for key, value in settings.items() if value is not _DELETE}
    if "sparsity" not in settings:
        settings["sparsity"] = _DELETE  # write_recipe's default gives one
    return write_recipe(tmp_path, checkpoint, slicing={"layout": "heterogeneous"}, **settings)


def _load(folder: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()


def test_keeping_every_neuron_gives_the_original_logits_through_decilm(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path)
    recipe = _recipe(tmp_path, checkpoint, target_params=1.0, mlp={"kept": 512})
    assert main(["run", str(recipe)]) == 0
    saved = _load(tmp_path / "out" / "model")
    assert type(saved).__name__ == "DeciLMForCausalLM"
    original = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert max_relative_logit_error(original, saved, random_batches(8192, padded=True)) < 1e-5


def test_a_pruned_run_saves_the_widths_its_report_names(tmp_path: Path) -> None:
    recipe = _recipe(tmp_path, _checkpoint(tmp_path))
    assert main(["run", str(recipe)]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    mlp = report["mlp"]
    widths = mlp["widths"]
    assert all(w % 256 == 0 for w in widths) and sum(widths) <= mlp["kept"] * 3 and sum(widths) < 3 * 512
    assert [sorted(int(w) for w in errors) for errors in mlp["width_errors"]] == [[0, 256, 512]] * 3
    saved = _load(tmp_path / "out" / "model")
    found = [0 if not layer.ffn_kept else layer.mlp.down_proj.in_features for layer in saved.model.layers]
    assert found == widths
    blocks = json.loads((tmp_path / "out" / "model" / "config.json").read_text())["block_configs"]
    assert [b["ffn"]["no_op"] for b in blocks] == [w == 0 for w in widths]
    assert parameter_count(saved) == report["params"]["pruned"]
    assert "per layer " + ", ".join(map(str, widths)) in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        ("qwen3", {}, "heterogeneous saves DeciLM: its blocks are Llama's and qwen3 blocks are not"),
        ("llama", {"mlp": _DELETE}, "add mlp: {} (or mlp.kept)"),
        ("llama", {"depth": {"removed": 1}}, "depth: a heterogeneous llama keeps its stream whole"),
        ("llama", {"sparsity": 0.2, "target_params": _DELETE, "budget": "all"}, "sparsity cuts the residual width"),
    ],
)
def test_what_the_layout_cannot_run_with_is_one_line(
    name: str, changes: dict, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = _recipe(tmp_path, _checkpoint(tmp_path, name), **changes)
    capsys.readouterr()
    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_an_attention_that_writes_little_is_removed_and_its_parameters_go_to_the_mlps(tmp_path: Path) -> None:
    checkpoint = _quiet_checkpoint(tmp_path)
    reports = {}
    for removing in (False, True):
        (tmp_path / str(removing)).mkdir()
        recipe = _recipe(tmp_path / str(removing), checkpoint, mlp={"remove_attention": removing})
        assert main(["run", str(recipe)]) == 0
        reports[removing] = json.loads((tmp_path / str(removing) / "out" / "report.json").read_text())
    kept, removed = reports[False]["mlp"], reports[True]["mlp"]
    assert kept.get("attention_removed") is None and removed["attention_removed"] == [1]
    assert removed["attention_units"] == 256 and len(removed["attention_errors"]) == 3
    assert removed["attention_errors"][1] < 1e-4 * min(removed["attention_errors"][0], removed["attention_errors"][2])
    assert sum(removed["widths"]) == sum(kept["widths"]) + 256  # the attention's worth, given to the MLPs
    assert reports[True]["params"]["pruned"] <= reports[False]["params"]["pruned"] + 256 * 3  # its norm aside
    folder = tmp_path / "True" / "out"
    blocks = json.loads((folder / "model" / "config.json").read_text())["block_configs"]
    assert [b["attention"]["no_op"] for b in blocks] == [False, True, False]
    saved = _load(folder / "model")
    assert (
        not hasattr(saved.model.layers[1], "self_attn") and parameter_count(saved) == reports[True]["params"]["pruned"]
    )
    markdown = (folder / "report.md").read_text()
    assert "attention removed in layers |  | 1 (each counted as 256 neurons) |" in markdown
    assert (
        f"{sum(removed['widths']):,} of the uniform {3 * removed['kept']:,} and 256 from removed attention" in markdown
    )


def test_eval_of_a_run_reloads_its_decilm_folder_and_reproduces_the_runs_figures(tmp_path: Path) -> None:
    """`compress eval` of a heterogeneous run (an attention removed, widths per layer) loads model/
    with the DeciLM code the run wrote, though the original's recipe trusts no remote code, and
    its perplexity and KL are the run's."""
    recipe = _recipe(tmp_path, _quiet_checkpoint(tmp_path), mlp={"remove_attention": True})
    assert main(["run", str(recipe)]) == 0
    assert main(["eval", str(tmp_path / "out"), "--output", str(tmp_path / "eval.json")]) == 0
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    ran = json.loads((tmp_path / "out" / "report.json").read_text())
    assert ran["mlp"]["attention_removed"] == [1]
    for side, key in (("baseline", "ppl"), ("pruned", "ppl"), ("pruned", "kl")):
        assert evaluated["metrics"][side][key] == pytest.approx(ran["metrics"][side][key], rel=1e-6)


def test_a_run_killed_in_the_mlp_stage_resumes_to_the_same_model(tmp_path: Path) -> None:
    from tests.run.test_resume import killed_and_resumed_is_whole

    recipe = _recipe(tmp_path, _checkpoint(tmp_path), evaluation=None)
    killed_and_resumed_is_whole(recipe, tmp_path, "mlp:1", sites=0)


def test_a_run_removing_an_attention_killed_in_the_mlp_stage_resumes_to_the_same_model(tmp_path: Path) -> None:
    from tests.run.test_resume import killed_and_resumed_is_whole

    recipe = _recipe(tmp_path, _quiet_checkpoint(tmp_path), evaluation=None, mlp={"remove_attention": True})
    killed_and_resumed_is_whole(recipe, tmp_path, "mlp:1", sites=0)
    assert json.loads((tmp_path / "run" / "report.json").read_text())["mlp"]["attention_removed"] == [1]


def test_the_dry_run_names_the_format_and_the_shared_neurons(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = _recipe(tmp_path, _checkpoint(tmp_path))
    capsys.readouterr()
    assert main(["run", str(recipe), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "per-layer MLP widths: saved as DeciLMForCausalLM (remote code)" in out
    assert "mlp: the 3 MLPs share" in out and "in steps of 256" in out
    assert "H pass on a fused copy (MLP widths)" in out  # allocate_by: fisher, the default
    assert "remove_attention" not in out
    assert not (tmp_path / "out").exists()
    assert (
        main(["run", str(_recipe(tmp_path, _checkpoint(tmp_path), mlp={"remove_attention": True})), "--dry-run"]) == 0
    )
    assert "mlp.remove_attention: a layer's attention may go too (DeciLM no_op)" in capsys.readouterr().out
    searching = _recipe(tmp_path, _checkpoint(tmp_path), mlp={"search": 5, "heldout_windows": 2})
    assert main(["run", str(searching), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "mlp.search: up to 5 allocations measured from the predicted one on 2 held-out windows" in out
    assert "mlp.search: measured allocations" in out  # its phase of the memory plan


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ({"allocate_by": "energy"}, "mlp.allocate_by weighs the per-layer widths of slicing.layout: heterogeneous"),
        ({"remove_attention": True}, "mlp.remove_attention removes attentions in slicing.layout: heterogeneous"),
        ({"merge_kv_heads": True}, "mlp.merge_kv_heads gives layers their own key-value heads in slicing.layout: het"),
        ({"search": 4}, "mlp.search measures allocations of the per-layer widths of slicing.layout: heterogeneous"),
    ],
)
def test_the_allocations_keys_are_refused_beside_another_layout(
    key: dict, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = write_recipe(tmp_path, _checkpoint(tmp_path), mlp={"kept": 256, **key})
    capsys.readouterr()
    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def _shared_kv_checkpoint(tmp_path: Path) -> Path:
    """A multi-head Llama (8 heads of 32, hidden 256) whose 8 KV heads are the same in every layer:
    merging them into one changes nothing the attention writes, and saves 114,688 parameters a
    layer (149 neurons at 768 a neuron; 144 in the allocation's grain of 16)."""
    folder = save_tiny_checkpoint(
        tmp_path / "shared-kv",
        "llama",
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=32,
        intermediate_size=512,
        num_hidden_layers=3,
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for layer in model.model.layers:
        for linear in (layer.self_attn.k_proj, layer.self_attn.v_proj):
            linear.weight.data.copy_(linear.weight.data[:32].repeat(8, 1))
    model.save_pretrained(folder)
    return folder


def test_kv_heads_that_merge_for_free_buy_the_mlps_a_step_and_save_per_layer(tmp_path: Path) -> None:
    checkpoint = _shared_kv_checkpoint(tmp_path)
    reports = {}
    for merging in (False, True):
        (tmp_path / str(merging)).mkdir()
        recipe = _recipe(tmp_path / str(merging), checkpoint, mlp={"merge_kv_heads": merging})
        assert main(["run", str(recipe)]) == 0
        reports[merging] = json.loads((tmp_path / str(merging) / "out" / "report.json").read_text())
    whole, merged = reports[False]["mlp"], reports[True]["mlp"]
    assert whole.get("kv_heads") is None
    assert merged["attention_units"] == 336 and merged["kv_units"] == {"1": 192, "2": 224, "4": 256}  # in 16s
    for kv_errors, width_errors in zip(merged["kv_errors"], merged["width_errors"], strict=True):
        assert max(kv_errors.values()) < 1e-6 * width_errors["256"]  # the same heads: merged for free
    assert sum(k < 8 for k in merged["kv_heads"]) >= 2 and set(merged["kv_heads"]) <= {1, 2, 4, 8}
    assert sum(merged["widths"]) >= sum(whole["widths"]) + 256  # what the merges saved, given to the MLPs
    assert merged["widths"] != whole["widths"]
    folder = tmp_path / "True" / "out" / "model"
    blocks = json.loads((folder / "config.json").read_text())["block_configs"]
    assert [8 // b["attention"]["n_heads_in_group"] for b in blocks] == merged["kv_heads"]
    saved = _load(folder)
    assert [layer.self_attn.k_proj.out_features // 32 for layer in saved.model.layers] == merged["kv_heads"]
    uniform = reports[False]["params"]["pruned"] + (3 * whole["kept"] - sum(whole["widths"])) * 768  # the plan's
    assert parameter_count(saved) == reports[True]["params"]["pruned"] <= uniform
    assert reports[True]["metrics"]["pruned"]["kl"] < reports[False]["metrics"]["pruned"]["kl"]
    markdown = (tmp_path / "True" / "out" / "report.md").read_text()
    freed = sum(336 - merged["kv_units"][str(kv)] for kv in merged["kv_heads"] if kv < 8)
    assert f"and {freed:,} from merged KV heads |" in markdown
    heads = ", ".join(map(str, merged["kv_heads"]))
    assert (
        f"KV heads per layer (merged) |  | {heads} (neurons an attention counts as at 1: 192, 2: 224, 4: 256) |"
        in markdown
    )
    (tmp_path / "both").mkdir()  # removal beside merging: one count for an attention in the report
    recipe = _recipe(tmp_path / "both", checkpoint, mlp={"merge_kv_heads": True, "remove_attention": True})
    assert main(["run", str(recipe)]) == 0
    both = json.loads((tmp_path / "both" / "out" / "report.json").read_text())["mlp"]
    assert both["attention_units"] == 336 and both["attention_removed"] is not None and both["kv_heads"] is not None


@pytest.mark.slow  # a minute: two runs and a killed one
def test_a_run_merging_kv_heads_killed_in_the_mlp_stage_resumes_to_the_same_model(tmp_path: Path) -> None:
    from tests.run.test_resume import killed_and_resumed_is_whole

    recipe = _recipe(tmp_path, _shared_kv_checkpoint(tmp_path), evaluation=None, mlp={"merge_kv_heads": True})
    killed_and_resumed_is_whole(recipe, tmp_path, "mlp:1", sites=0)
    assert sum(k < 8 for k in json.loads((tmp_path / "run" / "report.json").read_text())["mlp"]["kv_heads"]) >= 2


def test_merging_kv_heads_where_each_attention_holds_one_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / "mqa", "llama", intermediate_size=512, num_key_value_heads=1)
    recipe = _recipe(tmp_path, checkpoint, target_params=0.9, mlp={"merge_kv_heads": True})
    capsys.readouterr()
    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert "mlp.merge_kv_heads: this model's attentions hold one key-value head each" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def _wide_checkpoint(tmp_path: Path) -> Path:
    """Four MLPs of 1,024 neurons: grids of five widths, room for the search to move steps."""
    return save_tiny_checkpoint(tmp_path / "wide", "llama", intermediate_size=1024, num_hidden_layers=4)


def test_the_search_measures_allocations_and_the_model_saves_where_it_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from compressor.engine import width_search
    from compressor.stages import mlp as stage

    seen: dict[str, object] = {}

    def evolve(start, grids, fitness, settings, **options):  # the real search, then one move it must save
        result = width_search.evolve(start, grids, fitness, settings, **options)
        moved = width_search.mutate(result.widths, grids, __import__("random").Random(1), 1)
        seen.update(start=list(start), moved=moved, kl=fitness(moved), result=result)
        return dataclasses.replace(result, widths=moved, kl=seen["kl"])

    monkeypatch.setattr(stage, "evolve", evolve)
    recipe = _recipe(tmp_path, _wide_checkpoint(tmp_path), target_params=0.75, mlp={"search": 6, "heldout_windows": 3})
    assert main(["run", str(recipe)]) == 0
    mlp = json.loads((tmp_path / "out" / "report.json").read_text())["mlp"]
    search, result = mlp["search"], seen["result"]
    assert mlp["widths"] == seen["moved"] != seen["start"] and search["predicted"] == seen["start"]
    assert sum(mlp["widths"]) == sum(search["predicted"]) and search["kl"] == seen["kl"]
    seq_len = yaml.safe_load(recipe.read_text())["calibration"]["seq_len"]
    assert search["windows"] == 3 and search["tokens"] == 3 * seq_len and search["measured"] == result.measured <= 6
    assert result.start_kl == search["predicted_kl"]
    saved = _load(tmp_path / "out" / "model")
    assert [layer.mlp.down_proj.in_features if layer.ffn_kept else 0 for layer in saved.model.layers] == mlp["widths"]
    assert "mlp.search" in (tmp_path / "out" / "report.md").read_text()


def test_a_run_searching_beside_a_removed_attention_killed_in_the_mlp_stage_resumes_to_the_same_model(
    tmp_path: Path,
) -> None:
    from tests.run.test_resume import killed_and_resumed_is_whole

    spec = {"remove_attention": True, "search": 4, "heldout_windows": 2}
    recipe = _recipe(tmp_path, _quiet_checkpoint(tmp_path), evaluation=None, mlp=spec)
    killed_and_resumed_is_whole(recipe, tmp_path, "mlp:1", sites=0)
    mlp = json.loads((tmp_path / "run" / "report.json").read_text())["mlp"]
    assert mlp["attention_removed"] == [1] and mlp["search"]["measured"] >= 2
    assert sum(mlp["widths"]) == sum(mlp["search"]["predicted"])
