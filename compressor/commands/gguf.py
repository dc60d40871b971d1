"""`compress export`: a run's saved model as one GGUF file for llama.cpp (and the engines that read
GGUF), converted by llama.cpp's own converter and, if asked, quantized by llama.cpp's own
quantizer. Nothing here reimplements either: the converter (`convert_hf_to_gguf.py`, from
llama.cpp's source or llama-cpp-python's source distribution) runs as a subprocess, and the
quantizer is `llama_model_quantize` of the llama-cpp-python library or a `llama-quantize` binary.

Two gaps of the converter are bridged, each only when it raises (`CONVERTER_BOOTSTRAP`): a
byte-level BPE tokenizer whose pre-tokenizer hash it does not know (a model trained here: the
name is read from `tokenizer.json`), and a DeciLM folder (the heterogeneous layout) whose vocabulary
is neither Llama 3's nor Llama 2's (it takes the converter's own byte-level path). Stdlib only, so
`benchmarks/gguf_check.py` imports it from a venv that has llama.cpp's tools and not this package.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compressor.errors import UserError
from compressor.stages.formats import saved_format

CONVERTER_ENV = "GGUF_CONVERTER"
"""The environment variable naming llama.cpp's `convert_hf_to_gguf.py` (beside `--converter`)."""

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
"""What the converter itself writes (its `--outtype`)."""

QUANT_BLOCKS = {"q8_0": 32, "q6_k": 256, "q5_k_m": 256, "q4_k_m": 256}
"""`--quantize` types (llama.cpp's own quantizer, `llama_model_quantize`, what `llama-quantize` runs),
and the row length each quantizes in blocks of. A row that misses a k-quant's 256 falls back to a
32-block type (q4_K to q5_0, q5_K to q5_1, q6_K to q8_0), and one that misses 32 to F16
(`tensor_type_fallback` in llama.cpp's llama-quant.cpp)."""

QUANT_TYPES = tuple(QUANT_BLOCKS)
FALLBACK_BLOCK = 32
"""The block of the types a k-quant's misfit row falls back to."""

CONVERTER_BOOTSTRAP = r"""
import os, runpy, sys
converter, fallback = sys.argv[1], sys.argv[2]
root = os.path.dirname(os.path.abspath(converter))
sys.path.insert(0, root)  # as when the script is run directly
if "NO_LOCAL_GGUF" not in os.environ:  # the converter's own gguf-py first, as the script itself does
    sys.path.insert(1, os.path.join(root, "gguf-py"))
try:
    import conversion.base as base  # llama.cpp >= mid-2025 splits the converter into conversion/
    cls = base.TextModel
    log = base.logger
except ImportError:  # older single-file converter: classes live in the script itself
    base = None
if base is not None and fallback:
    original = cls.get_vocab_base_pre
    def get_vocab_base_pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            log.warning("compressor: unknown pre-tokenizer hash, writing tokenizer.ggml.pre = %r", fallback)
            return fallback
    cls.get_vocab_base_pre = get_vocab_base_pre
try:
    import conversion.deci as deci
except ImportError:
    deci = None
if deci is not None:
    own_vocab = deci.DeciModel.set_vocab
    def set_vocab(self):
        try:
            own_vocab(self)
        except FileNotFoundError:  # neither Llama 3's nor Llama 2's vocabulary: the byte-level BPE path
            log.warning("compressor: DeciLM with a byte-level BPE vocabulary, written as Llama 3's is")
            self._set_vocab_gpt2()
    deci.DeciModel.set_vocab = set_vocab
sys.argv = [converter] + sys.argv[3:]
runpy.run_path(converter, run_name="__main__")
"""
"""Runs llama.cpp's converter unchanged but for the two gaps of the module docstring.

Why the first: the converter names a BPE pre-tokenizer (the regex split llama.cpp applies before the
merges) by hashing the ids the HF tokenizer gives for a fixed test string, and knows only the hashes
of published models; llama.cpp's own remedy (adding the model to convert_hf_to_gguf_update.py) fetches
from the hub and edits llama.cpp. Here the converter's own `get_vocab_base_pre` runs, and only when it
raises is the name given in argv[2] returned (empty: re-raise). A log line says so."""

PRE_TOKENIZER_NOTE = "compressor: unknown pre-tokenizer hash"


@dataclass(frozen=True)
class Converted:
    """What `convert` did: its seconds, and the pre-tokenizer it named where the converter knew none."""

    seconds: float
    pre_tokenizer: str | None


def infer_pre_tokenizer(model_dir: Path) -> str | None:
    """The llama.cpp pre-tokenizer name that tokenizer.json implies, where that is unambiguous."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    spec = json.loads(path.read_text())
    if spec.get("model", {}).get("type") != "BPE" or spec.get("normalizer") is not None:
        return None
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 1:
        pre = pre["pretokenizers"][0]
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space", False):
        return "gpt-2"  # GPT-2's split regex, which llama.cpp implements as LLAMA_VOCAB_PRE_TYPE_GPT2
    return None


@dataclass(frozen=True)
class Conversion:
    """How llama.cpp's converter runs: which script, under which Python, writing which type."""

    converter: Path
    outtype: str = "f16"
    pre_tokenizer: str = "auto"
    """The name written only where the converter knows no hash; auto: from tokenizer.json; none: never."""
    python: str = sys.executable


def convert(model_dir: Path, out_file: Path, conversion: Conversion, log_file: Path | None = None) -> Converted:
    """Run llama.cpp's converter on `model_dir` into `out_file`. Its output goes to `log_file`; a
    failure raises RuntimeError with the log's last lines."""
    named = conversion.pre_tokenizer
    fallback = infer_pre_tokenizer(model_dir) if named == "auto" else named
    fallback = "" if fallback in (None, "none") else fallback
    command = [conversion.python, "-c", CONVERTER_BOOTSTRAP, str(conversion.converter), fallback, str(model_dir)]
    command += ["--outtype", conversion.outtype, "--outfile", str(out_file)]
    out_file.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    seconds = time.perf_counter() - start
    output = done.stdout + done.stderr
    if log_file is not None:
        log_file.write_text(output)
    if done.returncode != 0 or not out_file.is_file():
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise RuntimeError(f"converter failed (exit {done.returncode}):\n{tail}")
    return Converted(seconds, fallback if PRE_TOKENIZER_NOTE in output else None)


def quantize(
    source: Path, target: Path, kind: str, threads: int, quantizer: Path | None = None, log_file: Path | None = None
) -> float:
    """Quantize the GGUF `source` to `kind` (`QUANT_TYPES`) into `target` with llama.cpp's own
    quantizer: the `llama-quantize` binary `quantizer`, else llama-cpp-python's library (what it
    prints goes to `log_file` where given); the seconds."""
    start = time.perf_counter()
    if quantizer is not None:
        done = subprocess.run(
            [str(quantizer), str(source), str(target), kind.upper(), str(threads)], capture_output=True, text=True
        )
        if log_file is not None:
            log_file.write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-1:]
            raise RuntimeError(f"{quantizer.name} could not quantize {source.name} to {kind}: {' '.join(tail)}")
        return time.perf_counter() - start
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}")
    params.nthread = threads
    with _output_into(log_file):
        failed = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if failed:
        raise RuntimeError(f"llama.cpp could not quantize {source.name} to {kind}")
    return time.perf_counter() - start


@contextmanager
def _output_into(log_file: Path | None) -> Iterator[None]:
    """What native code writes to this process's stdout and stderr, into `log_file` (None: left as it is)."""
    if log_file is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(log_file, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


FALLBACK = re.compile(r"(\d+) of (\d+) tensor\(s\) required fallback quantization")
"""llama.cpp's quantizer's count of tensors it kept in a wider type (a row not a multiple of its block)."""


def fallbacks(log: str) -> tuple[int, int] | None:
    """(tensors kept wider, tensors) from the quantizer's log; None where every tensor was quantized."""
    found = FALLBACK.search(log)
    return None if found is None else (int(found.group(1)), int(found.group(2)))


@dataclass(frozen=True)
class Exported:
    """What `compress export` wrote."""

    path: Path
    bytes: int
    model: Path
    outtype: str
    quantized: str | None
    pre_tokenizer: str | None
    convert_s: float
    quantize_s: float | None
    fallbacks: tuple[int, int] | None = None
    """(tensors the quantizer kept wider, tensors): widths not a multiple of the quantized type's block."""
    misaligned_width: int | None = None
    """The model's hidden size where it is not a multiple of `ALIGNED_WIDTH` (`misaligned_width`)."""
    off_block: list[OffBlock] = field(default_factory=list)
    """Quantized: the widths that miss the type's block (`widths_off_block`)."""


ALIGNED_WIDTH = 16
"""llama.cpp's float32 CPU prefill ran 1.5-2.8x slower at residual widths that are odd multiples of 8
than at multiples of 16 on an AVX-512 machine, whose registers hold 16 floats (docs/benchmarks.md,
"Every axis at one budget")."""


@dataclass(frozen=True)
class OffBlock:
    """A width of the saved model that misses a quantized type's block, and what rounds it (None:
    nothing in a recipe can, e.g. the heterogeneous layout's residual width, the original's)."""

    name: str
    width: int
    fix: str | None


def text_fields(model: Path) -> dict[str, Any]:
    """The saved config's text fields (a vision-language config's `text_config`; the rest's own):
    `models.towers.text_fields`, which this stdlib-only module cannot import."""
    config = json.loads((model / "config.json").read_text())
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def widths_off_block(fields: dict[str, Any], block: int) -> list[OffBlock]:
    """The widths llama.cpp's quantizer reads rows of (the residual, the MLP's or routed experts',
    a shared expert's, the attention's heads × head_dim) that are not multiples of `block`."""
    hidden, heads, head_dim = fields.get("hidden_size"), fields.get("num_attention_heads"), fields.get("head_dim")
    heterogeneous = "block_configs" in fields  # DeciLM: the stream is the original's, FFN widths steps of 256
    mlp = fields.get("moe_intermediate_size") or fields.get("intermediate_size")
    attention = heads * head_dim if isinstance(heads, int) and isinstance(head_dim, int) else None
    widths = [
        ("hidden size", hidden, None if heterogeneous else "slicing.round_to"),
        ("MLP width", mlp, "mlp.round_to, or a whole mlp.kept"),
        ("shared expert width", fields.get("shared_expert_intermediate_size"), "a whole mlp.shared_kept"),
        ("attention width (heads × head_dim)", None if attention == hidden else attention, "heads.kept"),
    ]
    return [OffBlock(name, width, fix) for name, width, fix in widths if isinstance(width, int) and width % block]


def wider_line(fallbacks: tuple[int, int], off: list[OffBlock], kind: str) -> str:
    """The quantizer's fallbacks (tensors kept wider, tensors) in words: what they went to, why
    (`rounding_advice`), and what would have avoided it."""
    wider, of = fallbacks
    went = (
        "went to F16"
        if QUANT_BLOCKS[kind] <= FALLBACK_BLOCK
        else f"fell back to a {FALLBACK_BLOCK}-block type, or to F16 where a row is not a multiple of {FALLBACK_BLOCK}"
    )
    return f"{wider} of {of} tensors {went}: {rounding_advice(off, kind)}"


def rounding_advice(off: list[OffBlock], kind: str) -> str:
    """Why the quantizer kept tensors wider, in words, and what would have avoided it."""
    block = QUANT_BLOCKS[kind]
    if not off:
        return f"rows not multiples of {kind}'s block of {block}"
    named = " and ".join(f"{o.name} {o.width}" for o in off)
    said = f"{named} {'is not a multiple' if len(off) == 1 else 'are not multiples'} of {kind}'s block of {block}"
    fixes = [o.fix for o in off if o.fix is not None]
    if fixes:
        said += f"; round to {block} with {', '.join(fixes)}"
        if block > FALLBACK_BLOCK and any(o.width % FALLBACK_BLOCK for o in off if o.fix is not None):
            said += f" ({FALLBACK_BLOCK} keeps them quantized, in a {FALLBACK_BLOCK}-block type)"
    if any(o.fix is None for o in off):
        said += (
            "; slicing.layout: heterogeneous keeps the original residual width, which no key rounds "
            "(slicing.layout: global does, with slicing.round_to)"
        )
    return said


def misaligned_width(fields: dict[str, Any]) -> int | None:
    """The hidden size of a config's `text_fields` where it is not a multiple of `ALIGNED_WIDTH`; else None."""
    hidden = fields.get("hidden_size")
    return hidden if isinstance(hidden, int) and hidden % ALIGNED_WIDTH else None


@dataclass(frozen=True)
class GgufSettings:
    """What `compress export` writes: the converter (None: found as `converter_script` says), its
    output type, and the llama.cpp type to quantize to (None: as converted) with its quantizer."""

    converter: Path | None = None
    outtype: str = "f16"
    quantize_to: str | None = None
    quantizer: Path | None = None
    pre_tokenizer: str = "auto"
    threads: int = 1


def export_gguf(
    source: Path,
    output: Path,
    settings: GgufSettings,
    *,
    overwrite: bool = False,
    starting: Callable[[Path], None] | None = None,
) -> Exported:
    """A run folder's `model/` (or a model folder) as the GGUF file `output`, written whole or not at
    all: converted into a scratch file beside it, quantized there if asked, then renamed. Every
    problem found before converting is a one-line UserError; `starting(model)` hears when the checks
    have passed and the converter starts."""
    outtype, quantize_to, quantizer = settings.outtype, settings.quantize_to, settings.quantizer
    model = model_folder(source)
    fields = text_fields(model)  # read before converting: the file is the model's, not the GGUF's
    misaligned = misaligned_width(fields)
    conversion = Conversion(converter_script(settings.converter), outtype, settings.pre_tokenizer)
    _check_target(output, overwrite, quantize_to, quantizer)
    if starting is not None:
        starting(model)
    scratch = Path(tempfile.mkdtemp(prefix=f".{output.stem}.", dir=output.parent))
    log = Path(tempfile.mkstemp(prefix="compress-export-", suffix=".log")[1])
    try:
        converted_file = scratch / f"{output.stem}-{outtype}.gguf"
        try:
            converted = convert(model, converted_file, conversion, log)
        except RuntimeError as error:
            last = str(error).splitlines()[-1] if str(error).splitlines() else str(error)
            raise UserError(f"llama.cpp's converter failed on {model}: {last.strip()} (its whole log: {log})") from None
        log.unlink()  # kept only where the converter failed
        final, seconds, wider = converted_file, None, None
        if quantize_to is not None:
            final = scratch / f"{output.stem}-{quantize_to}.gguf"
            quantized_log = scratch / "quantize.log"
            try:
                seconds = quantize(converted_file, final, quantize_to, settings.threads, quantizer, quantized_log)
            except RuntimeError as error:
                raise UserError(f"{error}; the converted file was not kept") from None
            wider = fallbacks(quantized_log.read_text(errors="replace")) if quantized_log.is_file() else None
        os.replace(final, output)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return Exported(
        output,
        output.stat().st_size,
        model,
        outtype,
        quantize_to,
        converted.pre_tokenizer,
        converted.seconds,
        seconds,
        wider,
        misaligned,
        [] if quantize_to is None else widths_off_block(fields, QUANT_BLOCKS[quantize_to]),
    )


def _check_target(output: Path, overwrite: bool, quantize_to: str | None, quantizer: Path | None) -> None:
    """The file to write, where it may be written, and the quantizer where one is asked for."""
    if output.suffix != ".gguf":
        raise UserError(f"--gguf must name a .gguf file, got '{output.name}'")
    if output.exists() and not overwrite:
        raise UserError(f"{output} exists; pass --overwrite to replace it, or give another --gguf")
    if not output.parent.is_dir():
        raise UserError(f"the folder of {output} does not exist; create it first")
    if quantize_to is not None:
        check_quantizer(quantizer)


def model_folder(source: Path) -> Path:
    """The model a run folder saved (`model/`), or `source` itself when it is a model folder; refused in
    one line when llama.cpp cannot read its format (`stages.formats`: a per-site `sliced_*` model) or it is neither."""
    model = source / "model" if (source / "report.json").is_file() else source
    config = model / "config.json"
    if not config.is_file():
        raise UserError(
            f"{source} is neither a run folder (report.json and model/) nor a model folder (config.json); give one"
        )
    fields = json.loads(config.read_text())
    found = saved_format(fields)
    if found.gguf_refusal is not None:
        raise UserError(f"{model} is a {found.name} model ({fields.get('model_type', '')}), {found.gguf_refusal}")
    return model


def converter_script(given: Path | None) -> Path:
    """llama.cpp's converter: `--converter`, else $GGUF_CONVERTER; one line saying where to get it."""
    path = given or (Path(os.environ[CONVERTER_ENV]) if os.environ.get(CONVERTER_ENV) else None)
    if path is None or not path.is_file():
        where = f"{path} is not a file; " if path is not None else ""
        raise UserError(
            f"{where}compress export runs llama.cpp's converter, convert_hf_to_gguf.py: give it with --converter "
            f"PATH or set {CONVERTER_ENV} (it is in llama.cpp's source, and in llama-cpp-python's source "
            f"distribution under vendor/llama.cpp/; docs/serving.md)"
        )
    return path.resolve()


def check_quantizer(quantizer: Path | None) -> None:
    """A quantizer is at hand: the `llama-quantize` binary given, or the llama-cpp-python library."""
    if quantizer is not None:
        if not (quantizer.is_file() and os.access(quantizer, os.X_OK)):
            raise UserError(f"--quantizer {quantizer} is not an executable file (llama.cpp's llama-quantize)")
        return
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise UserError(
            "--quantize runs llama.cpp's quantizer: install llama-cpp-python (pip install llama-cpp-python, "
            "which builds llama.cpp), or give llama.cpp's llama-quantize with --quantizer PATH"
        ) from None
