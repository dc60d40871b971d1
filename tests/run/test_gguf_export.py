"""`compress export` (issue 50, item 7): a run's stock model as one GGUF file, by llama.cpp's own
converter (and quantizer). Its plumbing is checked here with stand-in converters: the converter's
arguments, the file written whole or not at all, and every refusal in one line, exit 2, nothing
written. With llama-cpp-python installed and $GGUF_CONVERTER set, a slow test converts a pruned
stock model for real and scores it in llama.cpp against transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from compressor.cli import main

FAKE_CONVERTER = """
import sys
args = sys.argv[1:]
model, out = args[0], args[args.index("--outfile") + 1]
outtype = args[args.index("--outtype") + 1]
if "FAIL" in model:
    print("loading model parts", flush=True)
    print("ValueError: cannot map tensor 'model.layers.0.mlp.gate_proj.weight'", file=sys.stderr)
    raise SystemExit(1)
open(out, "wb").write(b"GGUF" + outtype.encode() + b"|" + model.encode())
"""
"""Writes a file naming what it was given, or fails like the converter on a model it cannot map."""


LLAMA_CPP_PPL = """
import json, math, sys
import numpy as np
import llama_cpp
tokens = json.loads(sys.argv[2])
n = len(tokens)
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=n, n_batch=n, n_ubatch=n, logits_all=True, verbose=False)
llm.eval(tokens)
scores = np.array(llm.scores[:n], dtype=np.float64)
shifted = scores[:-1] - scores[:-1].max(-1, keepdims=True)
logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
print(math.exp(-logp[np.arange(n - 1), tokens[1:]].mean()))
"""
"""llama.cpp's perplexity of the token ids given, scoring tokens 1..n-1 from positions 0..n-2."""


def _model(folder: Path, model_type: str = "llama", **config: Any) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, **config}))
    return folder


def _run(folder: Path, model_type: str = "llama", **config: Any) -> Path:
    _model(folder / "model", model_type, **config)
    (folder / "report.json").write_text("{}")
    return folder


@pytest.fixture
def converter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "llama.cpp" / "convert_hf_to_gguf.py"
    path.parent.mkdir()
    path.write_text(FAKE_CONVERTER)
    monkeypatch.delenv("GGUF_CONVERTER", raising=False)
    return path


def test_a_run_folder_s_model_is_converted_by_the_converter_and_written_whole(
    converter: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _run(tmp_path / "run")
    out = tmp_path / "exported" / "model.gguf"
    out.parent.mkdir()
    assert main(["export", str(run), "--gguf", str(out), "--converter", str(converter), "--outtype", "f32"]) == 0
    assert out.read_bytes() == b"GGUFf32|" + str((run / "model").resolve()).encode()
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.gguf"]  # no scratch left
    assert f"wrote {out}" in capsys.readouterr().out
    os.environ["GGUF_CONVERTER"] = str(converter)  # the variable names it as --converter does
    try:
        assert main(["export", str(run / "model"), "--gguf", str(out), "--overwrite"]) == 0
    finally:
        del os.environ["GGUF_CONVERTER"]
    assert out.read_bytes().startswith(b"GGUFf16|")


@pytest.mark.parametrize(
    ("config", "noted"),
    [
        ({"hidden_size": 216}, 216),
        ({"hidden_size": 224}, None),
        ({"hidden_size": 1152, "text_config": {"hidden_size": 200}}, 200),  # a tower: the text model's width
        ({}, None),  # no width to judge
    ],
)
def test_a_width_llama_cpp_prefills_slowly_is_named_with_the_fix(
    config: dict[str, Any], noted: int | None, converter: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """An odd multiple of 8 (the default round_to's widths) is exported, with a note saying so."""
    run = _run(tmp_path / "run", **config)
    out = tmp_path / "model.gguf"
    assert main(["export", str(run), "--gguf", str(out), "--converter", str(converter)]) == 0
    said = capsys.readouterr().out.replace("\n", " ")
    assert out.is_file()
    assert ("is not a multiple of 16" in said) is (noted is not None)
    assert ("a slicing.round_to that is a multiple of 16" in said) is (noted is not None)
    if noted is not None:
        assert f"hidden size {noted} " in said


def test_a_failing_converter_is_one_line_with_its_last_words_and_leaves_nothing(
    converter: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _run(tmp_path / "FAIL-run")
    out = tmp_path / "out" / "model.gguf"
    out.parent.mkdir()
    capsys.readouterr()
    assert main(["export", str(run), "--gguf", str(out), "--converter", str(converter)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "llama.cpp's converter failed on" in err
    assert "cannot map tensor 'model.layers.0.mlp.gate_proj.weight'" in err and "its whole log:" in err
    log = Path(err.rsplit("its whole log: ", 1)[1].rstrip(")\n"))
    assert "loading model parts" in log.read_text()
    log.unlink()
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        (lambda t: _run(t / "run", "sliced_llama"), [], "is a per-site model (sliced_llama), a class llama.cpp"),
        (lambda t: t, [], "is neither a run folder (report.json and model/) nor a model folder (config.json)"),
        (lambda t: _run(t / "run"), ["--gguf-name"], "--gguf must name a .gguf file, got 'model.bin'"),
        (lambda t: _run(t / "run"), ["--exists"], "exists; pass --overwrite to replace it"),
        (lambda t: _run(t / "run"), ["--no-converter"], "compress export runs llama.cpp's converter"),
        (lambda t: _run(t / "run"), ["--quantize", "q8_0"], "--quantize runs llama.cpp's quantizer: install"),
        (lambda t: _run(t / "run"), ["--quantize", "q8_0", "--quantizer", "/nonexistent"], "is not an executable"),
    ],
)
def test_bad_exports_are_one_line_exit_2_and_write_nothing(
    make,
    args: list[str],
    message: str,
    converter: Path,
    tmp_path: Path,
    capsys,
    monkeypatch,  # noqa: ANN001
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as where llama-cpp-python is not installed
    (tmp_path / "in").mkdir()
    source = make(tmp_path / "in")
    out = tmp_path / "out" / ("model.bin" if "--gguf-name" in args else "model.gguf")
    out.parent.mkdir()
    if "--exists" in args:
        out.write_bytes(b"kept")
    command = ["export", str(source), "--gguf", str(out)]
    command += [] if "--no-converter" in args else ["--converter", str(converter)]
    command += [a for a in args if a not in ("--gguf-name", "--exists", "--no-converter")]
    capsys.readouterr()
    assert main(command) == 2
    said = capsys.readouterr()
    err = said.err
    assert message in err and err.count("\n") == 1 and said.out == ""  # nothing said before the refusal
    assert [p.name for p in out.parent.iterdir()] == (["model.gguf"] if "--exists" in args else [])
    if "--exists" in args:
        assert out.read_bytes() == b"kept"


@pytest.mark.slow
def test_a_pruned_stock_model_exported_scores_in_llama_cpp_as_in_transformers(tmp_path: Path) -> None:
    """The real path, where llama-cpp-python is installed and $GGUF_CONVERTER names its converter: the
    bundled reference Llama pruned to a stock model (its width a multiple of 32), exported at float32 and at Q8_0; llama.cpp's
    perplexity of held-out tokens equals transformers' to 1e-4 (float32) and within 2% (Q8_0)."""
    pytest.importorskip("llama_cpp")
    converter = os.environ.get("GGUF_CONVERTER")
    if not converter or not Path(converter).is_file():
        pytest.skip("$GGUF_CONVERTER does not name llama.cpp's convert_hf_to_gguf.py")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.conftest import EXAMPLES
    from tests.run.test_cli import write_recipe

    slicing = {"layout": "global", "round_to": 32}  # Q8_0's block: every matrix quantizes (none falls back)
    recipe = write_recipe(tmp_path, EXAMPLES / "ref-llama", slicing=slicing, evaluation=None, calibration__seq_len=128)
    assert main(["run", str(recipe)]) == 0
    model = tmp_path / "out" / "model"
    tokenizer = AutoTokenizer.from_pretrained(model)
    text = (EXAMPLES / "data" / "valid-demo.jsonl").read_text().splitlines()[0]
    tokens = tokenizer.encode(json.loads(text)["text"], add_special_tokens=False)[:256]
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)(torch.tensor([tokens])).logits[0]
    expected = float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(tokens[1:])).exp())

    def llama_cpp_ppl(path: Path) -> float:
        """In a fresh interpreter: llama.cpp's OpenMP and torch's in one process can crash it."""
        done = subprocess.run(
            [sys.executable, "-c", LLAMA_CPP_PPL, str(path), json.dumps(tokens)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return float(done.stdout.strip().splitlines()[-1])

    f32, q8 = tmp_path / "model-f32.gguf", tmp_path / "model-q8_0.gguf"
    assert main(["export", str(tmp_path / "out"), "--gguf", str(f32), "--outtype", "f32"]) == 0
    assert main(["export", str(tmp_path / "out"), "--gguf", str(q8), "--outtype", "f32", "--quantize", "q8_0"]) == 0
    assert llama_cpp_ppl(f32) == pytest.approx(expected, rel=1e-4)
    assert llama_cpp_ppl(q8) == pytest.approx(expected, rel=2e-2)
    assert q8.stat().st_size < 0.3 * f32.stat().st_size  # 8.5 bits a weight where f32 has 32


def test_a_quantizer_binary_quantizes_and_the_tensors_it_kept_wider_are_said(
    converter: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`--quantizer` (llama.cpp's llama-quantize) is given the converted file, the target and the type;
    the tensors its log says it kept wider (rows not a multiple of the type's block) are named."""
    quantizer = tmp_path / "llama-quantize"
    quantizer.write_text(
        "#!/bin/sh\n"
        'cp "$1" "$2"; printf "%s" "$3" >> "$2"\n'
        'echo "llama_model_quantize_impl: WARNING: 38 of 57 tensor(s) required fallback quantization"\n'
    )
    quantizer.chmod(0o755)
    run = _run(tmp_path / "run")
    out = tmp_path / "out" / "model.gguf"
    out.parent.mkdir()
    command = ["export", str(run), "--gguf", str(out), "--converter", str(converter)]
    assert main([*command, "--quantize", "q4_k_m", "--quantizer", str(quantizer)]) == 0
    assert out.read_bytes().endswith(b"Q4_K_M") and out.read_bytes().startswith(b"GGUFf16|")
    said = capsys.readouterr().out
    assert "quantized to q4_k_m" in said and "38 of 57 tensors fell back to a 32-block type" in said
    assert [p.name for p in out.parent.iterdir()] == ["model.gguf"]
    # the widths the run chose are read from the saved config, and the line names those off the block
    both = _run(tmp_path / "both", hidden_size=216, intermediate_size=552)
    command = ["export", str(both), "--gguf", str(tmp_path / "both.gguf"), "--converter", str(converter)]
    assert main([*command, "--quantize", "q8_0", "--quantizer", str(quantizer)]) == 0
    said = " ".join(capsys.readouterr().out.split())  # rich folds the line
    assert "38 of 57 tensors went to F16: hidden size 216 and MLP width 552 are not multiples of q8_0's block" in said
    assert "round to 32 with slicing.round_to, mlp.round_to, or a whole mlp.kept" in said
    assert "not a multiple of 16" not in said  # rounding to 32 is rounding to 16: said once


@pytest.mark.parametrize(
    ("config", "kind", "said", "unsaid"),
    [
        (  # a global layout's residual width: its key, and the 32-block fallback it would keep
            {"hidden_size": 216, "intermediate_size": 512},
            "q4_k_m",
            "hidden size 216 is not a multiple of q4_k_m's block of 256; round to 256 with slicing.round_to "
            "(32 keeps them quantized, in a 32-block type)",
            "mlp.round_to",
        ),
        (  # widths already multiples of 32: the fallback keeps them quantized, so no note of it
            {"hidden_size": 224, "intermediate_size": 576},
            "q4_k_m",
            "hidden size 224 and MLP width 576 are not multiples of q4_k_m's block of 256; round to 256 with "
            "slicing.round_to, mlp.round_to, or a whole mlp.kept",
            "32 keeps",
        ),
        (  # DeciLM keeps the original stream: no key rounds it
            {"hidden_size": 576, "intermediate_size": None, "block_configs": [{}], "num_attention_heads": 9},
            "q4_k_m",
            "hidden size 576 is not a multiple of q4_k_m's block of 256; slicing.layout: heterogeneous keeps the "
            "original residual width, which no key rounds (slicing.layout: global does, with slicing.round_to)",
            "round to 256",
        ),
        (  # a vision-language checkpoint: its text tower's widths
            {"text_config": {"hidden_size": 200, "intermediate_size": 512}, "hidden_size": 1024},
            "q8_0",
            "hidden size 200 is not a multiple of q8_0's block of 32",
            "1024",
        ),
        (  # routed experts: their width, not the dense layers'
            {"hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 552},
            "q8_0",
            "MLP width 552 is not a multiple of q8_0's block of 32; round to 32 with mlp.round_to, or a whole mlp.kept",
            "768",
        ),
        (  # fewer query heads beside an explicit head_dim
            {"hidden_size": 256, "num_attention_heads": 2, "head_dim": 64, "intermediate_size": 768},
            "q4_k_m",
            "attention width (heads × head_dim) 128 is not a multiple of q4_k_m's block of 256; round to 256 with "
            "heads.kept",
            "hidden size",
        ),
    ],
)
def test_the_widths_a_quantized_type_cannot_hold_are_named_with_what_rounds_them(
    config: dict[str, Any], kind: str, said: str, unsaid: str, tmp_path: Path
) -> None:
    """llama.cpp quantizes rows in blocks (32; 256 for the k-quants): each saved width that misses the
    block is named with the recipe key that rounds it, read from the config the run saved."""
    from compressor.commands.gguf import QUANT_BLOCKS, rounding_advice, text_fields, widths_off_block

    fields = text_fields(_model(tmp_path / "model", **config))
    advice = rounding_advice(widths_off_block(fields, QUANT_BLOCKS[kind]), kind)
    assert said in advice and unsaid not in advice
