"""Does a saved checkpoint survive llama.cpp? Convert it to GGUF and compare perplexity and speed.

For each `--model` folder (a stock Hugging Face Llama checkpoint: the dense model, a pruned one, ...):

1. convert it to GGUF with llama.cpp's own converter, `convert_hf_to_gguf.py` (run as a subprocess,
   `--outtype f32` unless told otherwise), into `--output`;
2. tokenise the held-out JSONL (`text` field) with the folder's HF tokenizer, documents joined with
   EOS, and cut `--windows` consecutive non-overlapping windows of `--seq-len` tokens;
3. compute the perplexity of exactly those token ids with transformers (float32, CPU) and with
   llama.cpp (llama_cpp.Llama, logits_all=True): log-softmax at positions 0..L-2 scoring tokens 1..L-1;
4. time llama.cpp prefill (one window of L tokens) and decode (one token at a time through the KV
   cache after a short prompt, batch 1) in a fresh process: one warm-up, then the median of `--repeats`;
5. print a table and write JSON (`--json`).

It also checks that llama.cpp's own tokenizer (from the GGUF) encodes the held-out documents to the
same ids as the HF tokenizer ("tok match"), which is what says the GGUF's pre-tokenizer is right.

Set-up (a separate venv; llama-cpp-python compiles llama.cpp from source, ~11 min on 2 cores):

    python3 -m venv /work/gguf-venv
    /work/gguf-venv/bin/pip install torch==2.13.0    # pinned first, as in the Makefile: no CUDA wheels
    mkdir -p /work/gguf-src && cd /work/gguf-src
    /work/gguf-venv/bin/pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d .
    tar xzf llama_cpp_python-0.3.36.tar.gz
    CMAKE_ARGS="-DGGML_NATIVE=ON" /work/gguf-venv/bin/pip install --no-binary llama-cpp-python \\
        ./llama_cpp_python-0.3.36.tar.gz
    /work/gguf-venv/bin/pip install transformers==5.24.0 numpy sentencepiece safetensors \\
        ./llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py
    # the converter is llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py (same llama.cpp
    # as the compiled library); pass it with --converter or set GGUF_CONVERTER.

Run (from the repository root):

    /work/gguf-venv/bin/python benchmarks/gguf_check.py \\
        --converter /work/gguf-src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py \\
        --model ../shared/models/ref-llama --model runs/demo-pca-25/model
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse
import gc
import hashlib
import json
import multiprocessing
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# this venv has llama.cpp's tools, not necessarily compressor: its stdlib-only GGUF module, from the checkout
sys.path.insert(0, str(REPO))
from compressor.commands.gguf import (
    QUANT_TYPES,
    Conversion,
    convert,
    quantize,
)  # the converter and quantizer, as export runs them

DEFAULT_DATA = REPO.parent / "shared" / "corpus" / "valid.jsonl"
DEFAULT_OUTPUT = REPO / "benchmarks" / "results" / "gguf"


@dataclass
class ModelResult:
    """Everything measured for one model folder."""

    model: str
    gguf: str = ""
    gguf_bytes: int = 0
    gguf_meta: dict[str, Any] = field(default_factory=dict)
    pre_tokenizer_fallback: str | None = None
    n_params: int = 0
    n_windows: int = 0
    seq_len: int = 0
    n_scored_tokens: int = 0
    windows_sha256: str = ""
    ppl_transformers: float = float("nan")
    ppl_llama_cpp: float = float("nan")
    ppl_rel_diff: float = float("nan")
    token_nll_max_abs_diff: float = float("nan")
    token_nll_mean_abs_diff: float = float("nan")
    tokenizer_docs_checked: int = 0
    tokenizer_docs_identical: int = 0
    prefill_tokens_per_s: float = float("nan")
    decode_tokens_per_s: float = float("nan")
    prefill_times_s: list[float] = field(default_factory=list)
    decode_times_s: list[float] = field(default_factory=list)
    convert_s: float = 0.0
    quantize_s: float | None = None
    error: str | None = None


# ---------------------------------------------------------------- conversion


def gguf_metadata(path: Path, converter: Path) -> dict[str, Any]:
    """Shape-related metadata of a GGUF file (via the gguf package, or the converter's gguf-py)."""
    try:
        import gguf
    except ImportError:
        sys.path.insert(1, str(converter.parent / "gguf-py"))
        import gguf
    reader = gguf.GGUFReader(str(path))

    def value(key: str) -> Any:
        fld = reader.fields.get(key)
        if fld is None:
            return None
        if hasattr(fld, "contents"):
            return fld.contents()
        part = fld.parts[fld.data[0]]
        return bytes(part).decode() if fld.types and fld.types[0] == gguf.GGUFValueType.STRING else part.tolist()[0]

    arch = value("general.architecture")
    keys = [
        "embedding_length",
        "block_count",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.key_length",
        "attention.value_length",
        "rope.dimension_count",
        "expert_count",  # a Mixture-of-Experts model's (None otherwise)
        "expert_used_count",
        "expert_feed_forward_length",
    ]
    meta: dict[str, Any] = {
        "general.architecture": arch,
        "general.file_type": value("general.file_type"),
        "tokenizer.ggml.pre": value("tokenizer.ggml.pre"),
    }
    meta.update({f"{arch}.{k}": value(f"{arch}.{k}") for k in keys})
    return meta


# ---------------------------------------------------------------- data


def read_texts(path: Path) -> list[str]:
    """The `text` field of each JSONL line."""
    with path.open() as handle:
        return [json.loads(line)["text"] for line in handle if line.strip()]


def build_windows(tokenizer: Any, texts: Sequence[str], n_windows: int, seq_len: int) -> np.ndarray:
    """`n_windows` consecutive non-overlapping windows of `seq_len` ids (documents joined with EOS)."""
    eos = tokenizer.eos_token_id
    need = n_windows * seq_len
    ids: list[int] = []
    for text in texts:
        if ids and eos is not None:
            ids.append(eos)
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        if len(ids) >= need:
            break
    usable = min(n_windows, len(ids) // seq_len)
    if usable < n_windows:
        print(f"  warning: only {len(ids)} tokens, {usable} windows of {seq_len}", file=sys.stderr)
    return np.asarray(ids[: usable * seq_len], dtype=np.int64).reshape(usable, seq_len)


def target_nll(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """-log p(tokens[1:]) from logits at positions 0..L-2 (float64 log-softmax)."""
    x = logits[:-1].astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(x).sum(axis=-1))
    return log_z - x[np.arange(len(tokens) - 1), tokens[1:]]


# ---------------------------------------------------------------- transformers


def transformers_nll(model_dir: Path, windows: np.ndarray, trust_remote_code: bool) -> tuple[np.ndarray, int]:
    """Per-token NLL of every window under transformers (float32, CPU), and the parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, trust_remote_code=trust_remote_code
    ).eval()
    n_params = sum(p.numel() for p in model.parameters())
    rows = []
    with torch.inference_mode():
        for window in windows:
            logits = model(torch.from_numpy(window)[None]).logits[0].float().numpy()
            rows.append(target_nll(logits, window))
    del model
    gc.collect()
    return np.stack(rows), n_params


# ---------------------------------------------------------------- llama.cpp


def llama_nll(
    gguf_path: Path, windows: np.ndarray, threads: int, tokenizer: Any, texts: Sequence[str], n_docs: int
) -> tuple[np.ndarray, int, int]:
    """Per-token NLL of every window under llama.cpp (each window from an empty cache), and how many
    of the first `n_docs` documents llama.cpp's own tokenizer encodes to the same ids as the HF one."""
    from llama_cpp import Llama

    seq_len = windows.shape[1]
    llm = Llama(
        model_path=str(gguf_path),
        n_ctx=seq_len,
        n_batch=seq_len,
        n_ubatch=seq_len,
        logits_all=True,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    rows = []
    for window in windows:
        llm.reset()
        llm.eval(window.tolist())
        rows.append(target_nll(np.array(llm.scores[:seq_len]), window))
    docs = list(texts[:n_docs])
    same = sum(
        llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        == tokenizer.encode(text, add_special_tokens=False)
        for text in docs
    )
    llm.close()
    return np.stack(rows), same, len(docs)


def llama_speed(
    gguf_path: Path, window: np.ndarray, threads: int, prompt_len: int, decode_steps: int, repeats: int
) -> tuple[list[float], list[float]]:
    """Timed prefill of `window` and decode of `decode_steps` single tokens after `prompt_len` (seconds).

    Decode feeds the window's own next tokens (teacher forcing) one at a time through the KV cache,
    batch 1, logits for the last token only: the work of greedy generation without a sampler.
    """
    from llama_cpp import Llama

    seq_len = len(window)
    tokens = window.tolist()
    while len(tokens) < prompt_len + decode_steps:
        tokens += window.tolist()
    n_ctx = max(seq_len, prompt_len + decode_steps)
    llm = Llama(
        model_path=str(gguf_path),
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        logits_all=False,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )

    def prefill() -> float:
        llm.reset()
        start = time.perf_counter()
        llm.eval(tokens[:seq_len])
        return time.perf_counter() - start

    def decode() -> float:
        llm.reset()
        llm.eval(tokens[:prompt_len])
        start = time.perf_counter()
        for token in tokens[prompt_len : prompt_len + decode_steps]:
            llm.eval([token])
        return time.perf_counter() - start

    prefill(), decode()  # warm-up
    prefill_times = [prefill() for _ in range(repeats)]
    decode_times = [decode() for _ in range(repeats)]
    llm.close()
    return prefill_times, decode_times


# ---------------------------------------------------------------- versions and report


def converter_version(converter: Path) -> dict[str, Any]:
    """What can be learnt about the converter's llama.cpp: git commit, gguf-py version, sdist version."""
    root = converter.parent
    info: dict[str, Any] = {"path": str(converter)}
    git = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if git.returncode == 0 and git.stdout.strip():
        info["llama_cpp_commit"] = git.stdout.strip()
    pyproject = root / "gguf-py" / "pyproject.toml"
    if pyproject.is_file() and (m := re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M)):
        info["gguf_py_version"] = m.group(1)
    sdist = root.parent.parent  # llama_cpp_python-X/vendor/llama.cpp/convert_hf_to_gguf.py
    pkg_info = sdist / "PKG-INFO"
    if pkg_info.is_file() and (m := re.search(r"^Version:\s*(\S+)", pkg_info.read_text(), re.M)):
        info["llama_cpp_python_sdist"] = m.group(1)
    changelog = sdist / "CHANGELOG.md"
    if "llama_cpp_commit" not in info and changelog.is_file():
        if m := re.search(r"llama\.cpp@([0-9a-f]{7,40})", changelog.read_text()):
            info["llama_cpp_commit"] = m.group(1) + " (from llama-cpp-python CHANGELOG)"
    return info


def versions(converter: Path) -> dict[str, Any]:
    """Library versions of this process and of the converter."""
    import llama_cpp
    import torch
    import transformers

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "llama_cpp_python": llama_cpp.__version__,
    }
    try:
        out["llama_cpp_system_info"] = llama_cpp.llama_print_system_info().decode().strip()
    except Exception:  # noqa: BLE001 - informational only
        pass
    out["converter"] = converter_version(converter)
    return out


def short_name(model_dir: str | Path) -> str:
    """A label for a model folder: its name, with the run folder's for `<run>/model`."""
    path = Path(model_dir)
    return f"{path.parent.name}/{path.name}" if path.name == "model" else path.name


def print_table(results: Sequence[ModelResult]) -> None:
    """A fixed-width table of the headline numbers."""
    head = [
        "model",
        "params",
        "gguf MB",
        "ppl HF",
        "ppl llama.cpp",
        "rel diff",
        "max |dNLL|",
        "tok match",
        "prefill tok/s",
        "decode tok/s",
    ]
    rows = []
    for r in results:
        if r.error:
            rows.append([short_name(r.model), "error"] + ["-"] * (len(head) - 2))
            continue
        rows.append(
            [
                short_name(r.model),
                f"{r.n_params / 1e6:.2f}M",
                f"{r.gguf_bytes / 2**20:.1f}",
                f"{r.ppl_transformers:.4f}",
                f"{r.ppl_llama_cpp:.4f}",
                f"{r.ppl_rel_diff:+.2e}",
                f"{r.token_nll_max_abs_diff:.1e}",
                f"{r.tokenizer_docs_identical}/{r.tokenizer_docs_checked}",
                f"{r.prefill_tokens_per_s:,.0f}",
                f"{r.decode_tokens_per_s:,.0f}",
            ]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for line in [head, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(line, widths))))
    for r in results:
        if r.error:
            print(f"{short_name(r.model)}: {r.error.splitlines()[0]}; last line: {r.error.splitlines()[-1].strip()}")


# ---------------------------------------------------------------- main


def check_model(model_dir: Path, args: argparse.Namespace, texts: Sequence[str], index: int) -> ModelResult:
    """Convert, score and time one model folder."""
    from transformers import AutoTokenizer

    result = ModelResult(model=str(model_dir), seq_len=args.seq_len)
    gguf_path = args.output / f"{index:02d}-{short_name(model_dir).replace('/', '-')}-{args.outtype}.gguf"
    if args.reuse_gguf and gguf_path.is_file():
        print(f"  reusing {gguf_path}")
    else:
        print(f"  converting -> {gguf_path}")
        conversion = Conversion(args.converter, args.outtype, args.pre_tokenizer, args.converter_python)
        converted = convert(model_dir, gguf_path, conversion, gguf_path.with_suffix(".convert.log"))
        result.convert_s, result.pre_tokenizer_fallback = converted.seconds, converted.pre_tokenizer
        if result.pre_tokenizer_fallback:
            print(f"  converter did not know the pre-tokenizer hash; wrote '{result.pre_tokenizer_fallback}'")
    if args.quantize is not None:  # scored and timed quantized, against transformers' float32
        quantized = gguf_path.with_name(f"{gguf_path.stem}-{args.quantize}.gguf")
        print(f"  quantizing -> {quantized}")
        result.quantize_s = quantize(gguf_path, quantized, args.quantize, args.threads)
        gguf_path = quantized
    result.gguf, result.gguf_bytes = str(gguf_path), gguf_path.stat().st_size
    result.gguf_meta = gguf_metadata(gguf_path, args.converter)

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=args.trust_remote_code)
    windows = build_windows(tokenizer, texts, args.windows, args.seq_len)
    result.n_windows = len(windows)
    result.n_scored_tokens = windows.shape[0] * (windows.shape[1] - 1)
    result.windows_sha256 = hashlib.sha256(windows.tobytes()).hexdigest()[:16]

    print(f"  transformers: {len(windows)} x {args.seq_len} tokens")
    nll_hf, result.n_params = transformers_nll(model_dir, windows, args.trust_remote_code)
    print("  llama.cpp: perplexity and tokenizer check")
    nll_cpp, result.tokenizer_docs_identical, result.tokenizer_docs_checked = llama_nll(
        gguf_path, windows, args.threads, tokenizer, texts, args.tokenizer_docs
    )
    result.ppl_transformers = float(np.exp(nll_hf.mean()))
    result.ppl_llama_cpp = float(np.exp(nll_cpp.mean()))
    result.ppl_rel_diff = (result.ppl_llama_cpp - result.ppl_transformers) / result.ppl_transformers
    diff = np.abs(nll_cpp - nll_hf)
    result.token_nll_max_abs_diff, result.token_nll_mean_abs_diff = float(diff.max()), float(diff.mean())

    # Timed in a fresh process: once torch has run here its OpenMP worker threads compete with
    # llama.cpp's for the cores (on 2 cores this cut decode from ~1,300 to ~260 tokens/s).
    print(f"  llama.cpp: speed (warm-up + {args.repeats}, separate process)")
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        prefill, decode = pool.submit(
            llama_speed, gguf_path, windows[0], args.threads, args.prompt_len, args.decode_steps, args.repeats
        ).result()
    result.prefill_times_s, result.decode_times_s = prefill, decode
    result.prefill_tokens_per_s = args.seq_len / statistics.median(prefill)
    result.decode_tokens_per_s = args.decode_steps / statistics.median(decode)
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        type=Path,
        action="append",
        required=True,
        help="HF model folder; repeat to compare several side by side",
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="held-out JSONL with a `text` field")
    parser.add_argument(
        "--converter",
        type=Path,
        default=os.environ.get("GGUF_CONVERTER"),
        help="llama.cpp's convert_hf_to_gguf.py (default: $GGUF_CONVERTER)",
    )
    parser.add_argument(
        "--converter-python",
        default=sys.executable,
        help="interpreter that runs the converter (needs torch, transformers, numpy)",
    )
    parser.add_argument(
        "--outtype",
        default="f32",
        choices=["f32", "f16", "bf16", "q8_0", "auto"],
        help="GGUF weight type passed to the converter",
    )
    parser.add_argument(
        "--pre-tokenizer",
        default="auto",
        help="llama.cpp pre-tokenizer name written only if the converter does not know the "
        "tokenizer's hash; 'auto' infers it from tokenizer.json, 'none' never overrides",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="folder for the GGUF files")
    parser.add_argument("--reuse-gguf", action="store_true", help="skip conversion where the GGUF exists")
    parser.add_argument(
        "--quantize",
        choices=QUANT_TYPES,
        help="quantize each converted GGUF with llama.cpp's quantizer and score that one",
    )
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt before the timed decode steps")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizer-docs", type=int, default=50, help="documents for the tokenizer check")
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="llama.cpp and torch threads; llama.cpp's OpenMP threads spin, so on a busy "
        "machine the timings collapse: use fewer threads or a quiet machine",
    )
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="JSON report (default: OUTPUT/gguf_check.json)")
    args = parser.parse_args(argv)
    if args.converter is None or not Path(args.converter).is_file():
        parser.error("--converter PATH/convert_hf_to_gguf.py is required (or set GGUF_CONVERTER)")
    args.converter = Path(args.converter).resolve()
    args.json = args.json or args.output / "gguf_check.json"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Check every model folder, print the table, write the JSON."""
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    texts = read_texts(args.data)
    results = []
    for index, model_dir in enumerate(args.model):
        print(f"[{index + 1}/{len(args.model)}] {model_dir}")
        try:
            results.append(check_model(model_dir.resolve(), args, texts, index))
        except Exception as error:  # noqa: BLE001 - report it and go on with the other folders
            print(f"  failed: {error}", file=sys.stderr)
            results.append(ModelResult(model=str(model_dir), error=f"{type(error).__name__}: {error}"))
    print()
    print_table(results)
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "cpu_count": os.cpu_count(),
        "data": str(args.data),
        "outtype": args.outtype,
        "quantize": args.quantize,
        "windows": args.windows,
        "seq_len": args.seq_len,
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps,
        "repeats": args.repeats,
        "threads": args.threads,
        "versions": versions(args.converter),
        "models": [asdict(r) for r in results],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"\nJSON: {args.json}")
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
