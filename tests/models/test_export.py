"""Pruned folders carry their modelling code: they load where compressor is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from compressor.engine.pooling import PipelineStep
from compressor.engine.walk import prune
from compressor.models.export import write_remote_code
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout, kept_width
from compressor_plugins.pca import PCA
from tests.conftest import FAMILY_CONFIGS, copy_model, random_batches, tiny_model, widths_for

# Runs in a fresh interpreter where importing compressor fails, as on a machine without it; the
# same (eager) attention kernel as the models compressor's classes load, so "identical" can mean
# bit-identical. (Against the model in memory, before saving, it is equal to round-off only: the
# loaded weights are memory-mapped at the file's alignment, which some CPU kernels round by.)
LOADER = r"""
import json, sys
class NoCompressor:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("compressor", "compressor_plugins", "tests"):
            raise ImportError(f"{name} is not installed here")
sys.meta_path.insert(0, NoCompressor())
import torch
from transformers import AutoModelForCausalLM
ids = torch.tensor(json.loads(sys.argv[1]))
for folder in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.save(model(input_ids=ids).logits, folder + "/logits.pt")
    assert "compressor" not in sys.modules
"""


def test_pruned_folders_load_with_remote_code_and_without_compressor(tmp_path: Path) -> None:
    ids = random_batches(128, count=1, batch=2, length=12)[0].input_ids
    folders, expected = [], {}
    for name in sorted(FAMILY_CONFIGS):
        original = tiny_model(name)
        family = family_for(name)
        d = original.config.hidden_size
        widths = widths_for(name, original.config, kept_width(d, 0.25, 8), family.head_width_is_embedding_width)
        pruned = prune(
            copy_model(original),
            fixed_layout(original.config, family, widths),
            random_batches(128),
            [PipelineStep(PCA())],
        ).model
        folder = tmp_path / name
        pruned.save_pretrained(folder)
        assert write_remote_code(folder, family, name)
        reloaded = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        with torch.no_grad():  # the reload reads the same file, so its tensors sit at the same alignment
            expected[name] = reloaded(input_ids=ids).logits
            assert torch.allclose(expected[name], pruned(input_ids=ids).logits, rtol=0, atol=1e-6), name
        folders.append(str(folder))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "PYTHONPATH": ""}
    done = subprocess.run(
        [sys.executable, "-c", LOADER, json.dumps(ids.tolist()), *folders],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for name in sorted(FAMILY_CONFIGS):
        assert torch.equal(torch.load(tmp_path / name / "logits.pt"), expected[name]), name


def test_with_compressor_imported_the_folder_loads_without_remote_code(tmp_path: Path) -> None:
    original = tiny_model("llama")
    widths = widths_for("llama", original.config, kept_width(64, 0.25, 8), False)
    pruned = prune(
        copy_model(original),
        fixed_layout(original.config, family_for("llama"), widths),
        random_batches(128),
        [PipelineStep(PCA())],
    ).model
    pruned.save_pretrained(tmp_path)
    write_remote_code(tmp_path, family_for("llama"), "llama")
    assert (
        json.loads((tmp_path / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
        == "modeling_sliced.SlicedForCausalLM"
    )
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # the registered local class, no remote code
    assert type(reloaded).__module__ == "compressor.models.sliced"


def test_the_readme_snippet_for_a_folder_without_compressor_asks_nothing(tmp_path: Path) -> None:
    """README's remote-code snippet, run as written on a run folder with stdin closed: the model
    and its tokenizer load, and transformers never stops to ask about custom code."""
    from compressor.cli import main
    from tests.conftest import save_tiny_checkpoint
    from tests.run.test_cli import write_recipe

    recipe = write_recipe(tmp_path, save_tiny_checkpoint(tmp_path / "tiny"), evaluation=None)
    assert main(["run", str(recipe)]) == 0
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = [block.split("```")[0] for block in readme.split("```python\n")[1:]]
    snippet = next(block for block in blocks if "AutoTokenizer" in block and "trust_remote_code=True" in block)
    folder = str(tmp_path / "out" / "model")
    script = (
        LOADER.split("import torch")[0]
        + snippet.replace("runs/demo-pca-25/model", folder)
        + "print(type(model).__name__, len(tokenizer('a b c').input_ids))\n"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "PYTHONPATH": ""}
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Do you wish" not in done.stdout + done.stderr
    assert done.stdout.startswith("SlicedLlamaForCausalLM")


def test_the_modules_copied_into_modeling_sliced_import_only_what_the_copy_has() -> None:
    """`modeling_sliced.py` inlines `models.experts`, `models.families` then `models.sliced`, dropping
    their `compressor` imports line by line: experts may import nothing of compressor, families only
    `UserError` (the copy defines it) and what experts defines, sliced only what families defines, and
    each such import must be one line at the top."""
    import ast

    from compressor.models import experts, families, sliced

    def names(module: object) -> set[str]:
        body = ast.parse(Path(module.__file__).read_text()).body
        found = {node.name for node in body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        for node in body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            found |= {target.id for target in targets if isinstance(target, ast.Name)}
        return found

    allowed = {
        experts: {"compressor.errors": {"UserError"}},  # the copy's header defines it
        families: {"compressor.errors": {"UserError"}, "compressor.models.experts": names(experts)},
        sliced: {"compressor.models.families": names(families)},
    }
    for module, permitted in allowed.items():
        tree = ast.parse(Path(module.__file__).read_text())
        top = set(map(id, tree.body))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names]
                source = node.module if isinstance(node, ast.ImportFrom) else names[0]
                if source and source.split(".")[0] == "compressor":
                    assert id(node) in top and node.lineno == node.end_lineno, (module.__name__, node.lineno)
                    assert set(names) <= permitted.get(source, set()), (module.__name__, source, names)
