"""Does llama.cpp's converter read a pruned stock gpt-oss as gpt-oss's own class does?

No gpt-oss checkpoint is small enough to run here, so this builds a tiny random one of
`GptOssConfig` (the test suite's, with ref-llama's tokenizer for the converter's vocabulary),
prunes it with `compress run` (global layout, 3 of 4 experts, every expert 16 of 32 neurons,
`target_params: 0.8`), converts the original and the pruned folder with llama.cpp's own
`convert_hf_to_gguf.py` (through `gguf_check.convert`), and compares the GGUF's tensors with the
saved checkpoint's as transformers reads them: gate and up are the even and odd columns of
`gate_up_proj [E, d, 2f]`, the down projection `down_proj [E, f, d]` transposed, the router and
the attention sinks as they are. Equal tensors and the GGUF's metadata (expert count, widths)
say the converter takes the layout this project writes. It does not say llama.cpp computes the
same logits: that needs the compiled llama-cpp-python (`gguf_check.py --seq-len 128` on both
folders, under `--work`).

    .venv/bin/pip install ./llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py   # the converter's gguf-py
    .venv/bin/python benchmarks/gguf_experts.py \\
        --converter /work/gguf-src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py

Writes benchmarks/results/gguf_experts_gpt_oss.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from gguf_check import Conversion, convert, gguf_metadata  # run as a script: benchmarks/ is on sys.path
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--converter", type=Path, required=True, help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--work", type=Path, default=RESULTS / "gguf-experts", help="folders and GGUFs go here")
    return parser.parse_args()


def make_checkpoint(folder: Path) -> None:
    """The test suite's tiny gpt-oss with gpt-oss's own clamp, its vocabulary ref-llama's tokenizer's."""
    from tests.conftest import TOKENIZER_FILES, tiny_model

    model = tiny_model(  # llama.cpp fixes gpt-oss's clamp at 7 (the suite's 0.3 makes the clamps act)
        "gpt_oss", vocab_size=8192, eos_token_id=1, bos_token_id=0, pad_token_id=1, swiglu_limit=7.0
    )
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(SHARED / "models" / "ref-llama" / name, folder / name)


def prune(checkpoint: Path, work: Path) -> Path:
    """`compress run` on it: a stock gpt-oss with 3 experts of 16 neurons and a narrower stream."""
    recipe = {
        "model": {"path": str(checkpoint), "dtype": "float32", "attn_implementation": "eager"},
        "calibration": {
            "dataset": {"path": "json", "data_files": str(SHARED / "corpus" / "calib.jsonl")},
            "num_samples": 16,
            "seq_len": 128,
        },
        "target_params": 0.8,
        "slicing": {"layout": "global"},
        "pipeline": [{"strategy": "sensitivity"}],
        "experts": {"kept": 3},
        "mlp": {"kept": 16},
        "evaluation": None,
        "output": str(work / "run"),
    }
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    shutil.rmtree(work / "run", ignore_errors=True)
    subprocess.run([str(Path(sys.executable).parent / "compress"), "run", str(path)], check=True)
    return work / "run" / "model"


def compare(folder: Path, gguf_file: Path) -> dict[str, Any]:
    """Whether each GGUF tensor of layer 0's experts, router and sinks equals the checkpoint's."""
    import gguf

    tensors = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(gguf_file)).tensors}
    state: dict[str, np.ndarray] = {}
    for shard in folder.glob("*.safetensors"):
        state.update(load_file(shard))
    prefix = "model.layers.0."
    gate_up, bias = state[prefix + "mlp.experts.gate_up_proj"], state[prefix + "mlp.experts.gate_up_proj_bias"]
    pairs = {
        "ffn_gate_exps.weight": gate_up[:, :, ::2].transpose(0, 2, 1),
        "ffn_up_exps.weight": gate_up[:, :, 1::2].transpose(0, 2, 1),
        "ffn_gate_exps.bias": bias[:, ::2],
        "ffn_up_exps.bias": bias[:, 1::2],
        "ffn_down_exps.weight": state[prefix + "mlp.experts.down_proj"].transpose(0, 2, 1),
        "ffn_down_exps.bias": state[prefix + "mlp.experts.down_proj_bias"],
        "ffn_gate_inp.weight": state[prefix + "mlp.router.weight"],
        "ffn_gate_inp.bias": state[prefix + "mlp.router.bias"],
        "attn_sinks.weight": state[prefix + "self_attn.sinks"],
    }
    return {
        name: {"equal": bool(np.array_equal(tensors[f"blk.0.{name}"], value)), "shape": list(value.shape)}
        for name, value in pairs.items()
    }


def main() -> None:
    args = _args()
    args.work.mkdir(parents=True, exist_ok=True)
    original = args.work / "gpt-oss-tiny"
    make_checkpoint(original)
    pruned = prune(original, args.work)
    results: dict[str, Any] = {}
    for name, folder in (("original", original), ("pruned", pruned)):
        out = args.work / f"{name}.gguf"
        converted = convert(folder, out, Conversion(args.converter, "f32"), args.work / f"{name}.log")
        results[name] = {
            "convert_s": round(converted.seconds, 1),
            "pre_tokenizer_fallback": converted.pre_tokenizer,
            "metadata": gguf_metadata(out, args.converter),
            "tensors": compare(folder, out),
        }
        equal = all(t["equal"] for t in results[name]["tensors"].values())
        meta = results[name]["metadata"]
        print(
            f"{name}: {meta['general.architecture']}, experts {meta['gpt-oss.expert_count']} of width "
            f"{meta['gpt-oss.expert_feed_forward_length']}, embedding {meta['gpt-oss.embedding_length']}, "
            f"converted in {converted.seconds:.1f} s; layer 0's tensors equal the checkpoint's: {equal}"
        )
    path = RESULTS / "gguf_experts_gpt_oss.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
