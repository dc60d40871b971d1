"""A model family added by a plugin: registered through the hook, pruned exactly, reloadable."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from compressor.engine.pooling import PipelineStep
from compressor.engine.walk import prune
from compressor.errors import UserError
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout, kept_width
from compressor.models.sites import site_widths
from compressor.strategies.registry import PluginRegistry
from compressor_plugins.pca import PCA
from tests.conftest import (
    BUILTIN_PLUGINS,
    COMMON,
    EXAMPLES,
    ROOT,
    TOKENIZER_FILES,
    copy_model,
    max_relative_logit_error,
    random_batches,
)

PLUGIN = EXAMPLES / "arcee-family-plugin"


@pytest.fixture(scope="module")
def arcee_plugin():
    sys.path.insert(0, str(PLUGIN))
    try:
        yield importlib.import_module("compressor_arcee_family")
    finally:
        sys.path.remove(str(PLUGIN))


def tiny_arcee(**overrides):
    from transformers import AutoConfig

    config = AutoConfig.for_model("arcee", **{**COMMON, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.5 * torch.randn_like(param))
    return model


def test_arcee_is_unknown_without_the_plugin() -> None:
    with pytest.raises(UserError, match="model_type 'arcee' is not supported; supported model types: gemma"):
        family_for("arcee", {t: e.item for t, e in PluginRegistry().families().items()})


def test_a_known_family_not_described_yet_is_refused_with_its_reason() -> None:
    with pytest.raises(
        UserError, match="model_type 'deepseek_v3' is not supported yet: .*correction bias.*; supported"
    ):
        family_for("deepseek_v3")


def test_a_registered_family_prunes_exactly_and_reloads(arcee_plugin, tmp_path: Path) -> None:
    registry = PluginRegistry(extra_plugins=[arcee_plugin])
    entry = registry.families()["arcee"]
    assert entry.item.mlp_inputs == ("up_proj",) and entry.plugin != "built-in"
    family = entry.item
    original = tiny_arcee()
    d, layers = original.config.hidden_size, original.config.num_hidden_layers
    batches = random_batches(original.config.vocab_size, padded=True)
    rotated = prune(
        copy_model(original),
        fixed_layout(original.config, family, site_widths(family, layers, d, d, True)),
        batches,
        [PipelineStep(PCA())],
    )
    assert max_relative_logit_error(original, rotated.model, batches) <= 1e-4

    widths = site_widths(family, layers, d, kept_width(d, 0.25, 8), False)
    pruned = prune(
        copy_model(original), fixed_layout(original.config, family, widths), batches, [PipelineStep(PCA())]
    ).model
    assert pruned.model.layers[0].mlp.up_proj.in_features == 48
    pruned.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    prompt = batches[0].input_ids[:1, -6:]
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(pruned.generate(prompt, **settings), reloaded.generate(prompt, **settings))


def test_two_descriptions_of_one_model_type_are_refused(arcee_plugin) -> None:
    from compressor.models.families import ModelFamily
    from compressor.strategies.registry import hookimpl

    class Rival:
        @hookimpl
        def compressor_model_families(self) -> list[ModelFamily]:
            return [ModelFamily(name="my-llama", model_types=("llama",))]

    with pytest.raises(UserError, match="model_type 'llama' is described twice"):
        PluginRegistry(extra_plugins=[Rival()])


def test_installed_family_plugin_runs_from_a_recipe(tmp_path: Path) -> None:
    """Installed for real (pip --target), listed by `compress families`, used by `compress run`."""
    source = tmp_path / "src"
    shutil.copytree(PLUGIN, source)
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(site),
        "COLUMNS": "200",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "COMPRESS_PLUGINS": f"{BUILTIN_PLUGINS},arcee-family",
    }  # the suite pins its plugins (conftest)
    listing = subprocess.run(
        [sys.executable, "-m", "compressor.cli", "families"], env=env, capture_output=True, text=True, cwd=ROOT
    )
    assert listing.returncode == 0 and "compressor-arcee-family 0.1.0" in listing.stdout

    checkpoint = tmp_path / "arcee"
    tiny_arcee(vocab_size=8192).save_pretrained(checkpoint)
    for file in TOKENIZER_FILES:
        shutil.copy(EXAMPLES / "ref-llama" / file, checkpoint / file)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model: {{path: {checkpoint}}}\n"
        f"calibration: {{dataset: {{path: json, data_files: {EXAMPLES / 'data' / 'calib-demo.jsonl'}}}, "
        f"num_samples: 4, seq_len: 64}}\nsparsity: 0.25\npipeline: [{{strategy: pca}}]\noutput: out\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "compressor.cli", "run", str(recipe)], env=env, capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "report.json").is_file()
