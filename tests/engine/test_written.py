"""Writing as the walk goes: shards laid out before the walk hold, tensor for tensor, what
`save_pretrained` writes of the walked model; each layer leaves memory once written; a successor
of a killed writer trusts exactly the committed tensors; bases and H stay on disk."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from compressor.data.batches import Batch
from compressor.engine.checkpoint import Checkpoint, OnDisk
from compressor.engine.layerwise import final_streams
from compressor.engine.pooling import PipelineStep
from compressor.engine.shards import ShardWriter
from compressor.engine.streaming import streamed, streamed_model
from compressor.engine.walk import prune
from compressor.engine.walk_options import WalkOptions
from compressor.models.families import family_for
from compressor.models.layout import fixed_layout, kept_width
from compressor_plugins.pca import PCA
from compressor_plugins.sensitivity import Sensitivity
from tests.conftest import random_batches, tiny_model, widths_for


def _folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        found.update(load_file(str(shard)))
    return found


def _some_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "a.weight": torch.randn(7, 3),
        "b": torch.randn(5, dtype=torch.float64),
        "c": torch.randn(4, 4).to(torch.bfloat16),
        "d": torch.arange(3),
    }


def test_shards_written_tensor_by_tensor_read_back_as_save_file_writes_them(tmp_path: Path) -> None:
    tensors = _some_tensors()
    writer = ShardWriter(tmp_path / "out", tensors, max_shard_size=100)
    for name in reversed(list(tensors)):  # any order
        writer.write({name: tensors[name]})
    writer.finish()
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files[-1] == "model.safetensors.index.json" and len(files) > 2  # split as save_pretrained splits
    read = _folder_tensors(tmp_path / "out")
    assert read.keys() == tensors.keys() and all(torch.equal(read[k], v) for k, v in tensors.items())
    save_file(tensors, str(tmp_path / "whole.safetensors"))
    assert load_file(str(tmp_path / "whole.safetensors")).keys() == read.keys()


def test_a_writer_resumes_only_what_was_committed_and_refuses_what_was_not_planned(tmp_path: Path) -> None:
    tensors, progress = _some_tensors(), tmp_path / "written.json"
    first = ShardWriter(tmp_path / "out", tensors, progress=progress, max_shard_size=100)
    first.write({"a.weight": tensors["a.weight"]})
    first.commit()
    first.write({"b": tensors["b"]})  # killed before this one was committed
    first.close()
    second = ShardWriter(tmp_path / "out", tensors, progress=progress, max_shard_size=100)
    assert second.written == {"a.weight"} and second.missing() == ["b", "c", "d"]
    with pytest.raises(ValueError, match="planned as"):
        second.write({"c": tensors["c"].float()})
    with pytest.raises(ValueError, match="not a tensor of the planned shards"):
        second.write({"e": tensors["d"]})
    with pytest.raises(ValueError, match="never written"):
        second.finish()
    changed = {**tensors, "a.weight": torch.randn(8, 3)}  # another layout: nothing of the old shards trusted
    third = ShardWriter(tmp_path / "out", changed, progress=progress, max_shard_size=100)
    assert third.written == set()
    third.write(changed)
    third.finish()
    read = _folder_tensors(tmp_path / "out")
    assert all(torch.equal(read[k], v) for k, v in changed.items())
    # a layout that fits one file: the sharded layout's files and index go, none is read by mistake
    whole = ShardWriter(tmp_path / "out", changed, progress=progress)
    whole.write(changed)
    whole.finish()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]


def _walk(model, name: str, strategy, tie: bool, checkpoint: Checkpoint | None = None, **options):
    config = model.config
    widths = widths_for(name, config, kept_width(config.hidden_size, 0.25, 8), tie)  # a tied head is sliced
    return prune(
        model,
        fixed_layout(config, family_for(name), widths, tie_head=tie),
        random_batches(config.vocab_size, count=2),
        [PipelineStep(strategy, strategy.parse_options({}))],
        WalkOptions(**options, checkpoint=checkpoint),
    )


def _started(folder: Path) -> Checkpoint:
    checkpoint = Checkpoint(folder)
    checkpoint.start({"run": "this"})
    return checkpoint


@pytest.mark.parametrize(
    ("name", "strategy", "tie", "stream", "readers"),
    [
        ("llama", PCA(), False, True, False),
        ("llama", Sensitivity(), True, True, False),  # a tied head's fit, least squares: the same bits
        ("qwen3", Sensitivity(), False, False, True),
    ],
)
def test_a_walk_that_writes_as_it_goes_writes_what_save_pretrained_writes(
    tmp_path: Path, name: str, strategy, tie: bool, stream: bool, readers: bool
) -> None:
    family = family_for(name)
    original = tmp_path / "original"
    tiny_model(name, num_hidden_layers=3, tie_word_embeddings=tie).save_pretrained(original, max_shard_size="40KB")

    def load():
        if stream:
            return streamed_model(original, family, torch.float32, attn_implementation="eager")
        return AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32, attn_implementation="eager")

    expected = _walk(load(), name, strategy, tie, correct_readers=readers)
    expected.model.save_pretrained(tmp_path / "saved")
    model = load()
    written = tmp_path / "written"
    result = _walk(
        model,
        name,
        strategy,
        tie,
        _started(tmp_path / "checkpoint"),
        write_to=written,
        max_shard_size="20KB",
        correct_readers=readers,
    )
    layers = model.get_submodule(family.layers)
    assert all(p.is_meta for p in layers.parameters())  # every layer left memory once written
    assert (written / "model.safetensors.index.json").is_file()
    saved, wrote = _folder_tensors(tmp_path / "saved"), _folder_tensors(written)
    assert wrote.keys() == saved.keys()
    assert not [key for key, value in saved.items() if not torch.equal(wrote[key], value)]
    assert (written / "config.json").read_text() == (tmp_path / "saved" / "config.json").read_text()
    # bases and H stay in the checkpoint's files, read when asked, equal to the walk in memory's
    assert isinstance(result.bases, OnDisk)
    assert all(torch.equal(result.bases[site], basis) for site, basis in expected.bases.items())
    if readers:
        assert isinstance(result.readers, OnDisk)
        assert all(torch.equal(result.readers[site], reader) for site, reader in expected.readers.items())
    if isinstance(strategy, Sensitivity):
        assert isinstance(result.fisher, OnDisk)
        assert all(torch.equal(result.fisher[site], h) for site, h in expected.fisher.items())
    # the returned model reads its layers back from the written folder, one at a time
    assert streamed(result.model) is not None
    batches = [Batch(torch.randint(0, model.config.vocab_size, (2, 16)), torch.ones(2, 16, dtype=torch.long))]
    ours = final_streams(result.model, family, batches, torch.device("cpu"))
    theirs = final_streams(expected.model, family, batches, torch.device("cpu"))
    assert torch.equal(ours[0], theirs[0]) and streamed(result.model).peak_resident == 1
    reloaded = AutoModelForCausalLM.from_pretrained(written, attn_implementation="eager")
    ids = batches[0].input_ids
    assert torch.equal(reloaded(ids).logits, expected.model(ids).logits)


def test_a_walk_killed_while_writing_writes_only_uncommitted_layers_again(tmp_path: Path) -> None:
    original = tmp_path / "original"
    tiny_model("llama", num_hidden_layers=3).save_pretrained(original)
    family = family_for("llama")
    checkpoint = _started(tmp_path / "checkpoint")
    written = tmp_path / "written"
    first = _walk(streamed_model(original, family, torch.float32), "llama", PCA(), False, checkpoint, write_to=written)
    assert first.written_before == 0
    expected = _folder_tensors(written)
    # as if killed while writing the last layer: two layers committed, the last one's bytes spoilt
    record = checkpoint.written_record
    assert record is not None
    committed = [n for n in json.loads(record.read_text())["written"] if not n.startswith("model.layers.2.")]
    record.write_text(json.dumps({"written": committed}))
    shard = written / "model.safetensors"
    with open(shard, "r+b") as handle:
        length = struct.unpack("<Q", handle.read(8))[0]
        header = json.loads(handle.read(length))
        for name, entry in header.items():
            if name.startswith("model.layers.2."):
                begin, end = entry["data_offsets"]
                handle.seek(8 + length + begin)
                handle.write(b"\xff" * (end - begin))
    second = _walk(streamed_model(original, family, torch.float32), "llama", PCA(), False, checkpoint, write_to=written)
    assert second.written_before == 2 and second.loaded_sites == len(first.sites)
    again = _folder_tensors(written)
    assert not [key for key, value in expected.items() if not torch.equal(again[key], value)]


def test_a_reading_rank_keeps_h_on_disk_once_the_writing_rank_saved_it(tmp_path: Path) -> None:
    """A data-parallel rank above 0 (its checkpoint not writable) reads each site's H from rank 0's
    file, as rank 0 does, instead of holding every site's H."""
    from compressor.engine.parallel import Ranks
    from compressor.engine.sensitivity import SensitivitySource, estimate_sensitivity
    from compressor.engine.walk_options import PruneCall

    folder = tmp_path / "checkpoint"
    folder.mkdir()
    H = {"layers.0.attn": torch.randn(8, 8, dtype=torch.float64), "embedding": torch.eye(8, dtype=torch.float64)}
    Checkpoint(folder).save_fisher(H)

    def sensitivity(on_disk: bool):
        run = PruneCall(
            model=None,  # H comes from the checkpoint: the model is never run
            layout=SimpleNamespace(family=None),
            device=torch.device("cpu"),
            report=lambda *_: None,
            ranks=Ranks(1, 2),
            checkpoint=Checkpoint(folder, writable=False),
            tie_head=False,
            correct_readers=False,
        )
        return estimate_sensitivity(run, None, SensitivitySource(on_disk=on_disk), None)

    kept, held = sensitivity(True), sensitivity(False)
    assert isinstance(kept.values, OnDisk) and not isinstance(held.values, OnDisk)
    assert kept.loaded and kept.source == "checkpoint"
    for site, value in H.items():
        assert torch.equal(kept.at(site), value) and torch.equal(held.at(site), value)


@pytest.mark.parametrize(
    ("name", "tie", "stored", "dtype"),
    [("llama", False, torch.bfloat16, torch.float32), ("gemma", True, torch.bfloat16, torch.bfloat16)],
)
def test_a_global_walk_is_written_as_the_stock_model_save_stock_writes(
    tmp_path: Path, name: str, tie: bool, stored: torch.dtype, dtype: torch.dtype
) -> None:
    """One basis: the walk writes the original class at the kept width, tensor for tensor and config
    byte for byte what `stock.to_stock` saves after the walk in memory (Gemma: (1 + w) norms, a
    scaled embedding and a tied head whose final-norm diagonal is fitted on the final stream)."""
    from compressor.models.sites import EMBEDDING, site_ids
    from compressor.models.stock import head_stream, to_stock

    family = family_for(name)
    original = tmp_path / "original"
    tiny_model(name, num_hidden_layers=3).to(stored).save_pretrained(original, max_shard_size="40KB")
    config = AutoConfig.from_pretrained(original)  # as a run plans: the folder's config (its dtype, stored's)
    layout = fixed_layout(config, family, {s: 40 for s in site_ids(family, 3)}, tie_head=tie, layout="global")

    def walk(model, checkpoint: str, **options):
        batches = random_batches(config.vocab_size, count=2)
        step = [PipelineStep(PCA(), PCA().parse_options({}))]
        return prune(model, layout, batches, step, WalkOptions(**options, checkpoint=_started(tmp_path / checkpoint)))

    expected = walk(AutoModelForCausalLM.from_pretrained(original, dtype=dtype), "in-memory")
    stream = head_stream(expected.head_moment, expected.bases[EMBEDDING])
    _, record = to_stock(expected.model, family, config, tmp_path / "saved", tie=tie, stream=stream)
    written = tmp_path / "written"
    result = walk(streamed_model(original, family, dtype), "streamed", write_to=written, max_shard_size="20KB")
    saved, wrote = _folder_tensors(tmp_path / "saved"), _folder_tensors(written)
    assert wrote.keys() == saved.keys() and (f"{family.head}.weight" in wrote) is not tie
    assert not [key for key, value in saved.items() if not torch.equal(wrote[key], value)]
    assert (written / "config.json").read_text() == (tmp_path / "saved" / "config.json").read_text()
    assert result.stock == record and record["head"] == ("tied" if tie else "untied")
    # the returned model is the stock class, its layers read back from the written folder
    assert type(result.model).__name__ == type(AutoModelForCausalLM.from_pretrained(original)).__name__
    assert streamed(result.model) is not None
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=dtype)
    batches = [Batch(torch.randint(0, config.vocab_size, (2, 16)), torch.ones(2, 16, dtype=torch.long))]
    ours = final_streams(result.model, family, batches, torch.device("cpu"))
    theirs = final_streams(reloaded, family, batches, torch.device("cpu"))
    assert torch.equal(ours[0], theirs[0])
