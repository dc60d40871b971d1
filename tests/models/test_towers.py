"""Vision-language checkpoints pruned through their text tower (`compressor.models.towers`): the
run prunes the language model, maps the projector's output into the pruned stream, keeps the
vision encoder, and saves the whole checkpoint as its own class, which plain transformers loads;
what it cannot save that way is refused in one line before any work."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForImageTextToText,
    Gemma3Config,
    LlavaConfig,
    Mistral3Config,
    Qwen3_5Config,
    Qwen3_5MoeConfig,
)

from compressor.cli import main
from compressor.models.towers import text_model, tower_for
from tests.conftest import COMMON, EXAMPLES, FAMILY_CONFIGS, TOKENIZER_FILES
from tests.run.test_cli import _DELETE, write_recipe

VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, spatial_merge_size=2)
PATCH = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch: one row of pixel_values


def qwen_vl(tied: bool, text_type: str = "qwen3_5_text") -> AutoModelForImageTextToText:
    """Qwen3.5's vision-language model, dense (`qwen3_5_text`) or MoE (`qwen3_5_moe_text`)."""
    text = {**COMMON, **FAMILY_CONFIGS[text_type], "vocab_size": 8192}
    text.pop("model_type")
    config_class = Qwen3_5MoeConfig if text_type == "qwen3_5_moe_text" else Qwen3_5Config
    config = config_class(
        text_config=text,
        vision_config={**VISION, "out_hidden_size": COMMON["hidden_size"]},
        tie_word_embeddings=tied,
        image_token_id=8000,
    )
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():  # norms away from 1 (a fused scale), as in a trained model
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0.0, 0.3)
    return model


def save_vl(folder: Path, tied: bool, text_type: str = "qwen3_5_text") -> Path:
    qwen_vl(tied, text_type).save_pretrained(folder)
    for file in TOKENIZER_FILES:
        shutil.copy(EXAMPLES / "ref-llama" / file, folder / file)
    (folder / "preprocessor_config.json").write_text(json.dumps({"patch_size": 4}))
    return folder


def image_inputs() -> dict[str, torch.Tensor]:
    """Eight text tokens around one image of 2 x 2 patches (one merged image token)."""
    ids = torch.tensor([[5, 17, 8000, 99, 3, 250, 41, 7]])
    torch.manual_seed(1)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(4, PATCH),
        "image_grid_thw": torch.tensor([[1, 2, 2]]),
        "mm_token_type_ids": (ids == 8000).long(),
    }


@pytest.fixture(
    scope="module",
    params=[(False, "qwen3_5_text"), (True, "qwen3_5_text"), (True, "qwen3_5_moe_text")],
    ids=["untied", "tied", "moe"],
)
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_vl(tmp_path_factory.mktemp("qwen-vl"), *request.param)


def _names(checkpoint: Path) -> tuple[str, str]:
    """The checkpoint's class and its text model's type (dense or MoE)."""
    config = json.loads((checkpoint / "config.json").read_text())
    return config["architectures"][0], config["text_config"]["model_type"]


def test_the_text_model_is_the_language_model_and_head_of_the_checkpoint(checkpoint: Path) -> None:
    whole = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    text = text_model(whole, tower_for(whole.config))
    ids = image_inputs()["input_ids"].clone()
    ids[ids == 8000] = 11  # text only
    with torch.no_grad():
        expected = whole(input_ids=ids).logits
        got = text(input_ids=ids).logits
    assert type(text).__name__ == ("Qwen3_5MoeForCausalLM" if "Moe" in _names(checkpoint)[0] else "Qwen3_5ForCausalLM")
    assert torch.equal(got, expected)
    assert text.model is whole.model.language_model  # the same modules: no copy


def _run(tmp_path: Path, checkpoint: Path, **changes) -> int:
    tmp_path.mkdir()
    recipe = write_recipe(tmp_path, checkpoint, **changes)
    return main(["run", str(recipe)])


def test_a_global_run_saves_the_whole_checkpoint_as_its_own_class(checkpoint: Path, tmp_path: Path, capsys) -> None:
    """Nothing sliced (a rotation only): the saved vision-language model, loaded by plain
    transformers with compressor blocked, gives the original's logits on an image prompt, so
    the projector's output went through the embedding's basis and scale; sliced: the vision
    encoder is kept bit for bit and the text tower has the report's width."""
    assert _run(tmp_path / "whole", checkpoint, sparsity=0.0, slicing={"layout": "global"}) == 0
    cut = dict(sparsity=_DELETE, target_params=0.7, slicing={"layout": "global"})
    (tmp_path / "plan").mkdir()
    assert main(["run", str(write_recipe(tmp_path / "plan", checkpoint, **cut)), "--dry-run"]) == 0
    architecture, text_type = _names(checkpoint)
    assert f"a vision-language checkpoint: its text tower ({text_type}) is pruned" in capsys.readouterr().out
    assert _run(tmp_path / "cut", checkpoint, **cut) == 0
    script = (
        "import sys, torch\n"
        "sys.modules['compressor'] = None\n"
        "from transformers import AutoModelForImageTextToText\n"
        "folder, inputs, out = sys.argv[1], torch.load(sys.argv[2]), sys.argv[3]\n"
        "model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()\n"
        "with torch.no_grad():\n"
        "    logits = model(**inputs).logits\n"
        "    other = model(**{**inputs, 'pixel_values': inputs['pixel_values'].flip(0)}).logits\n"
        "torch.save({'class': type(model).__name__, 'logits': logits, 'other_image': other}, out)\n"
    )
    torch.save(image_inputs(), tmp_path / "inputs.pt")
    for run in ("whole", "cut"):
        folder = tmp_path / run / "out" / "model"
        subprocess.run(
            [sys.executable, "-c", script, str(folder), str(tmp_path / "inputs.pt"), str(tmp_path / f"{run}.pt")],
            check=True,
        )
    original = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = original(**image_inputs()).logits
    whole = torch.load(tmp_path / "whole.pt")
    assert whole["class"] == architecture
    assert ((whole["logits"] - expected).abs().max() / expected.abs().max()).item() < 1e-5
    # The image token changes what follows it: the projector's output reaches the pruned stream.
    cut = torch.load(tmp_path / "cut.pt")
    report = json.loads((tmp_path / "cut" / "out" / "report.json").read_text())
    width = report["stock"]["hidden_size"]
    assert width < COMMON["hidden_size"] and cut["logits"].shape == expected.shape
    assert torch.equal(cut["logits"][:, :2], cut["other_image"][:, :2])  # before the image: causal
    assert not torch.allclose(cut["logits"][:, 2:], cut["other_image"][:, 2:])
    saved = load_file(tmp_path / "cut" / "out" / "model" / "model.safetensors")
    before = load_file(checkpoint / "model.safetensors")
    vision = [name for name in before if name.startswith("model.visual.") and "merger.linear_fc2" not in name]
    assert vision and all(torch.equal(saved[name], before[name]) for name in vision)
    assert saved["model.visual.merger.linear_fc2.weight"].shape == (
        width,
        before["model.visual.merger.linear_fc2.weight"].shape[1],
    )
    config = json.loads((tmp_path / "cut" / "out" / "model" / "config.json").read_text())
    assert config["text_config"]["hidden_size"] == config["vision_config"]["out_hidden_size"] == width
    assert (tmp_path / "cut" / "out" / "model" / "preprocessor_config.json").is_file()
    assert "preprocessor_config.json" in report["stock"]["vision_language"]["copied"]
    assert report["metrics"]["pruned"]["kl"] > 0 and report["model"]["model_type"] == text_type


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"slicing": {"layout": "per_site"}}, "set slicing.layout: global"),
        ({"slicing": {"layout": "global"}, "model__load": "stream"}, "without model.load: stream"),
    ],
)
def test_what_a_whole_checkpoint_cannot_hold_is_refused_before_work(
    checkpoint: Path, tmp_path: Path, capsys, changes: dict, names: str
) -> None:
    recipe = write_recipe(tmp_path, checkpoint, evaluation=None, **changes)
    assert main(["run", str(recipe)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and names in error and _names(checkpoint)[0] in error
    assert not (tmp_path / "out").exists()


def test_an_undescribed_tower_is_refused(tmp_path: Path, capsys) -> None:
    LlavaConfig(architectures=["LlavaForConditionalGeneration"]).save_pretrained(tmp_path)
    recipe = write_recipe(tmp_path, tmp_path, evaluation=None, slicing={"layout": "global"})
    assert main(["run", str(recipe), "--dry-run"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0
    assert "vision-language checkpoint whose multimodal projector compressor does not describe" in error


def gemma_vl() -> AutoModelForImageTextToText:
    """A tiny Gemma 3 vision-language model: a SigLIP encoder of 4 x 4 patches pooled to 4 image tokens."""
    text = {**COMMON, **FAMILY_CONFIGS["gemma3_text"], "vocab_size": 8192}
    text.pop("model_type")
    config = Gemma3Config(
        text_config=text,
        vision_config=dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=4,
        ),
        mm_tokens_per_image=4,
        image_token_id=8000,
        boi_token_id=8001,
        eoi_token_id=8002,
    )
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():  # norms away from 1 and a projector that is not zero, as in a trained model
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("projection_weight"):
                parameter.normal_(0.0, 0.3)
    return model


def mistral_vl() -> AutoModelForImageTextToText:
    """A tiny Mistral 3 vision-language model: a Pixtral encoder of 4 x 4 patches merged to 4 image
    tokens, its projector's hidden layer as wide as the text model."""
    text = {**COMMON, **FAMILY_CONFIGS["mistral"], "vocab_size": 8192}
    vision = dict(
        model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2
    )
    config = Mistral3Config(
        text_config=text,
        vision_config={**vision, "image_size": 16, "patch_size": 4, "head_dim": 16},
        image_token_index=8000,
        spatial_merge_size=2,
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0.0, 0.3)
    return model


KEEP_STREAM = {
    # class: (a tiny model, an image prompt, extra inputs, what keeps the stream whole)
    "Gemma3ForConditionalGeneration": (
        gemma_vl,
        [5, 17, 8001, 8000, 8000, 8000, 8000, 8002, 99, 3],
        "token_type_ids=(ids == 8000).long()",
        "norms after each block",
    ),
    "Mistral3ForConditionalGeneration": (
        mistral_vl,
        [5, 17, 8000, 8000, 8000, 8000, 99, 3],
        "image_sizes=torch.tensor([[16, 16]])",
        "projector's hidden layer is as wide as the text model",
    ),
}


def test_without_mlp_a_gemma3_checkpoint_is_told_what_its_stock_class_can_prune(tmp_path: Path, capsys) -> None:
    """Gemma 3's text tower has norms after its blocks: one basis is not a stock Gemma 3, its MLPs are."""
    config = Gemma3Config(text_config={**COMMON, "model_type": "gemma3_text"})
    config.architectures = ["Gemma3ForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    recipe = write_recipe(tmp_path, tmp_path, evaluation=None, slicing={"layout": "global"})
    assert main(["run", str(recipe), "--dry-run"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "norms after each block" in error and "add mlp: {}" in error


@pytest.mark.parametrize("architecture", sorted(KEEP_STREAM))
def test_a_checkpoint_that_keeps_its_stream_saves_narrower_mlps_whole(
    architecture: str, tmp_path: Path, capsys
) -> None:
    """Gemma 3 (norms after the blocks) and Mistral 3 (a projector as wide as the text model) keep
    the text stream whole and prune its MLPs alone: the whole checkpoint is saved as its own class
    with the vision encoder and the projector bit for bit, plain transformers loads it, an image
    still changes what follows it, and its text logits are the run's text model's."""
    build, prompt, extra, why = KEEP_STREAM[architecture]
    source = tmp_path / "source"
    build().save_pretrained(source)
    for file in TOKENIZER_FILES:
        shutil.copy(EXAMPLES / "ref-llama" / file, source / file)
    stock = dict(sparsity=_DELETE, target_params=0.98, slicing={"layout": "global"}, mlp={})
    (tmp_path / "plan").mkdir()
    assert main(["run", str(write_recipe(tmp_path / "plan", source, **stock)), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "axes: MLP width" in out and why in out and "as it was (the stream is kept whole)" in out
    assert _run(tmp_path / "run", source, **stock) == 0
    folder = tmp_path / "run" / "out" / "model"
    report = json.loads((folder.parent / "report.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [architecture] and why in report["stock"]["residual"]
    assert config["text_config"]["intermediate_size"] == report["mlp"]["kept"] < COMMON["intermediate_size"]
    assert config["text_config"]["hidden_size"] == COMMON["hidden_size"] and report["kept_width"] == 64
    saved, before = load_file(folder / "model.safetensors"), load_file(source / "model.safetensors")
    kept = [name for name in before if "vision_tower" in name or "multi_modal_projector" in name]
    assert kept and all(torch.equal(saved[name], before[name]) for name in kept)
    script = (
        "import sys, torch\n"
        "sys.modules['compressor'] = None\n"
        "from transformers import AutoModelForImageTextToText\n"
        "folder, ids, out = sys.argv[1], torch.load(sys.argv[2]), sys.argv[3]\n"
        "model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()\n"
        "torch.manual_seed(0)\n"
        "images = [torch.randn(1, 3, 16, 16) for _ in range(2)]\n"
        f"kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), {extra})\n"
        "with torch.no_grad():\n"
        "    logits = [model(**kw, pixel_values=image).logits for image in images]\n"
        "    text = model(input_ids=ids[:, :2]).logits\n"
        "torch.save({'class': type(model).__name__, 'images': logits, 'text': text}, out)\n"
    )
    ids = torch.tensor([prompt])
    torch.save(ids, tmp_path / "ids.pt")
    subprocess.run(
        [sys.executable, "-c", script, str(folder), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")], check=True
    )
    out = torch.load(tmp_path / "out.pt")
    assert out["class"] == architecture
    first, second = out["images"]
    image_at = prompt.index(8000)
    assert torch.equal(first[:, :image_at], second[:, :image_at])  # before the image: causal
    assert not torch.allclose(first[:, image_at:], second[:, image_at:])
    whole = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(text_model(whole, tower_for(whole.config))(input_ids=ids[:, :2]).logits, out["text"])
    assert report["metrics"]["pruned"]["kl"] > 0


def test_a_moe_checkpoint_saves_fewer_narrower_experts_in_its_text_config(tmp_path: Path) -> None:
    """Qwen3.5-MoE's vision-language checkpoint with `experts` and `mlp`: the saved composite
    config says the kept count and width where its text model reads them (`text_config`), and plain
    transformers loads it with the report's parameters."""
    checkpoint = save_vl(tmp_path / "vl", True, "qwen3_5_moe_text")
    cut = dict(sparsity=_DELETE, target_params=0.8, slicing={"layout": "global"}, evaluation=None)
    assert _run(tmp_path / "cut", checkpoint, experts={"kept": 3}, mlp={"kept": 0.5}, **cut) == 0
    folder = tmp_path / "cut" / "out" / "model"
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    assert text["num_experts"] == text["num_local_experts"] == 3 and text["moe_intermediate_size"] == 16
    assert "num_experts" not in config  # not at the top, where no model of it reads it
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    layer = model.model.language_model.layers[0].mlp
    assert layer.experts.gate_up_proj.shape[:2] == (3, 32) and layer.gate.weight.shape[0] == 3
    report = json.loads((tmp_path / "cut" / "out" / "report.json").read_text())
    text_params = {id(p): p.numel() for p in (*model.model.language_model.parameters(), *model.lm_head.parameters())}
    assert sum(text_params.values()) == report["params"]["pruned"]  # the report counts the text tower
