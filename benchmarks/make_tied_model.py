"""Derive a model with tied embeddings from the reference model, for the tied-head figures.

`../shared` has no pretrained model with tied embeddings, and quality figures never come from
random weights. This ties `ref-llama`'s head to its embedding (the shared matrix starts as one
of the two, `--init`) and trains the whole model briefly on the calibration corpus (the text
pruning fits on anyway; `valid.jsonl` stays held out), so `target_params` with `tie_head` can
be measured on a trained tied model. Prints the held-out perplexity before and after, and
writes the model (bf16, with the tokenizer) to `--out`.

Run by hand (about 5 minutes on 2 CPU cores with the defaults):

    .venv/bin/python benchmarks/make_tied_model.py [--steps 300] [--out benchmarks/results/ref-llama-tied]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from transformers import AutoModelForCausalLM, AutoTokenizer

from compressor.data.text import batches_of, load_records, token_windows
from compressor.evaluation.metrics import compare, parameter_count

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"


def held_out_ppl(model: torch.nn.Module, batches: list) -> float:
    model.eval()
    return compare(None, model, batches, torch.device("cpu"))["pruned"]["ppl"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=SHARED / "models" / "ref-llama")
    parser.add_argument("--train", type=Path, default=SHARED / "corpus" / "calib.jsonl")
    parser.add_argument("--valid", type=Path, default=SHARED / "corpus" / "valid.jsonl")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ref-llama-tied")
    parser.add_argument(
        "--init",
        choices=("embedding", "head"),
        default="head",
        help="which of the two matrices the tied one starts from",
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    console = Console()
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    valid = batches_of(
        token_windows(load_records({"path": "json", "data_files": str(args.valid)}), tokenizer, 512, 64), 8
    )
    untied_ppl, untied_params = held_out_ppl(model, valid), parameter_count(model)
    source = model.get_input_embeddings() if args.init == "embedding" else model.get_output_embeddings()
    shared = torch.nn.Parameter(source.weight.detach().clone())
    model.config.tie_word_embeddings = True
    model.get_input_embeddings().weight = shared
    model.get_output_embeddings().weight = shared
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    tied_ppl = held_out_ppl(model, valid)

    windows = token_windows(
        load_records({"path": "json", "data_files": str(args.train)}), tokenizer, args.seq_len, args.steps * args.batch
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
    )
    model.train()
    started, losses = time.perf_counter(), []
    with Progress(console=console) as progress:
        task = progress.add_task("training the tied model", total=args.steps)
        for batch in windows.split(args.batch):
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            progress.update(task, advance=1, description=f"training the tied model (loss {loss.item():.3f})")
    trained_ppl = held_out_ppl(model, valid)

    if args.out.exists():
        shutil.rmtree(args.out)
    model.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    for extra in ("chat_template.jinja", "generation_config.json"):
        if (args.model / extra).exists() and not (args.out / extra).exists():
            shutil.copy(args.model / extra, args.out / extra)
    reloaded = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    result = {
        "source": str(args.model),
        "init": args.init,
        "steps": args.steps,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "train_s": round(time.perf_counter() - started, 1),
        "params": {"untied": untied_params, "tied": parameter_count(reloaded)},
        "valid_ppl": {
            "untied": untied_ppl,
            "tied_before_training": tied_ppl,
            "tied_trained": trained_ppl,
            "reloaded_bf16": held_out_ppl(reloaded, valid),
        },
        "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
    }
    (args.out / "derivation.json").write_text(json.dumps(result, indent=2) + "\n")
    console.print_json(json.dumps(result))


if __name__ == "__main__":
    main()
