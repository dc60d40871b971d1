"""Make the reference Mixture-of-Experts model the MoE figures are measured on (issue 48, item 6).

No real MoE small enough exists here, and quality figures never come from random weights. This
upcycles `ref-llama` into a Qwen3-MoE of its size class: its embeddings, attention and norms are
copied, and each layer's dense MLP (768 neurons) becomes `--experts` routed experts of
`--expert-width` neurons, each started from its own random subset of the dense neurons (down
projection scaled by 768/width, so every expert starts as an unbiased estimate of the dense MLP),
routed top-`--top-k` with renormalised weights (`norm_topk_prob`). Qwen3's per-head q/k norms,
which Llama has not, start at the measured RMS of each query and key dimension. With
`--shared-width` it is a Qwen2-MoE instead (no q/k norms; zero q/k/v biases): every layer also has
a shared expert of that width, gated by sigmoid(shared_expert_gate) (the gate starts at zero,
so at 1/2), started from its own subset of the dense neurons; the routed experts and the shared
one then each carry half of the dense MLP's output. The whole model
then trains on the calibration corpus (the text pruning fits on; `valid.jsonl` stays held out)
with Qwen3-MoE's load-balancing loss, long enough that the experts take distinct shares of the
tokens. Prints and writes (`derivation.json` beside the model) the held-out perplexity before
and after, each layer's expert load (share of routed tokens per expert) and its entropy.

Run by hand (about 15 minutes on 2 CPU cores with the defaults; the model is ~12M parameters,
25 MB in bf16, so it stays out of the repository):

    .venv/bin/python benchmarks/make_ref_moe.py [--steps 400] [--out benchmarks/results/ref-moe]
    .venv/bin/python benchmarks/make_ref_moe.py --shared-width 384 --out benchmarks/results/ref-moe-shared
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch
from make_tied_model import held_out_ppl  # run as a script: benchmarks/ is on sys.path
from rich.console import Console
from rich.progress import Progress
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, Qwen2MoeConfig, Qwen3MoeConfig

from compressor.data.text import batches_of, load_records, token_windows
from compressor.evaluation.metrics import parameter_count

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"


def moe_config(dense: object, experts: int, width: int, top_k: int, shared_width: int = 0) -> PretrainedConfig:
    """A Qwen3-MoE config with the dense model's shape and `experts` routed experts in every layer
    (a Qwen2-MoE with a shared expert of `shared_width` neurons, where it is given)."""
    kind, extra = Qwen3MoeConfig, {}
    if shared_width:
        kind, extra = Qwen2MoeConfig, {"shared_expert_intermediate_size": shared_width, "qkv_bias": True}
    return kind(
        **extra,
        vocab_size=dense.vocab_size,
        hidden_size=dense.hidden_size,
        intermediate_size=dense.intermediate_size,
        moe_intermediate_size=width,
        num_hidden_layers=dense.num_hidden_layers,
        num_attention_heads=dense.num_attention_heads,
        num_key_value_heads=dense.num_key_value_heads,
        head_dim=dense.head_dim,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        max_position_embeddings=dense.max_position_embeddings,
        rms_norm_eps=dense.rms_norm_eps,
        rope_parameters=dict(dense.rope_parameters),
        tie_word_embeddings=False,
        bos_token_id=dense.bos_token_id,
        eos_token_id=dense.eos_token_id,
        pad_token_id=dense.pad_token_id,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    )


@torch.no_grad()
def upcycle(dense: torch.nn.Module, config: PretrainedConfig, probe: torch.Tensor, seed: int) -> torch.nn.Module:
    """The MoE with the dense model's weights where the two agree (see the module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    moe = AutoModelForCausalLM.from_config(config).to(torch.float32)
    state = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    missing, unexpected = moe.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    for name, parameter in moe.named_parameters():
        if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):  # Qwen2-MoE's, which Llama has not
            parameter.zero_()
    queries: dict[int, torch.Tensor] = {}
    keys: dict[int, torch.Tensor] = {}
    hooks = []
    for index, layer in enumerate(dense.model.layers):
        hooks.append(layer.self_attn.q_proj.register_forward_hook(lambda m, a, o, i=index: queries.__setitem__(i, o)))
        hooks.append(layer.self_attn.k_proj.register_forward_hook(lambda m, a, o, i=index: keys.__setitem__(i, o)))
    dense(input_ids=probe)
    for hook in hooks:
        hook.remove()
    head = config.head_dim
    f = dense.config.intermediate_size
    shared = getattr(config, "shared_expert_intermediate_size", 0)
    half = 0.5 if shared else 1.0  # with a shared expert, the routed ones carry half the dense output
    for index, (source, target) in enumerate(zip(dense.model.layers, moe.model.layers, strict=True)):
        attention = target.self_attn
        if hasattr(attention, "q_norm"):
            attention.q_norm.weight.copy_(queries[index].reshape(-1, head).pow(2).mean(0).sqrt())
            attention.k_norm.weight.copy_(keys[index].reshape(-1, head).pow(2).mean(0).sqrt())
        gate, up, down = source.mlp.gate_proj.weight, source.mlp.up_proj.weight, source.mlp.down_proj.weight
        experts = target.mlp.experts
        for e in range(config.num_experts):
            rows = torch.randperm(f, generator=generator)[: config.moe_intermediate_size]
            experts.gate_up_proj[e].copy_(torch.cat([gate[rows], up[rows]]))
            experts.down_proj[e].copy_(down[:, rows] * (half * f / config.moe_intermediate_size))
        target.mlp.gate.weight.normal_(0.0, 0.02, generator=generator)
        if shared:  # sigmoid(0) = 1/2 of an unbiased estimate of the dense MLP: the other half
            rows = torch.randperm(f, generator=generator)[:shared]
            mlp = target.mlp.shared_expert
            mlp.gate_proj.weight.copy_(gate[rows])
            mlp.up_proj.weight.copy_(up[rows])
            mlp.down_proj.weight.copy_(down[:, rows] * (f / shared))
            target.mlp.shared_expert_gate.weight.zero_()
    return moe


@torch.no_grad()
def expert_load(model: torch.nn.Module, batches: list) -> list[dict[str, object]]:
    """Per layer: each expert's share of the routed (token, slot) pairs on `batches`, and the
    entropy of that distribution over log(E) (1: perfectly even)."""
    model.eval()
    experts, k = model.config.num_experts, model.config.num_experts_per_tok
    counts = torch.zeros(model.config.num_hidden_layers, experts)
    for batch in batches:
        out = model(input_ids=batch.input_ids, output_router_logits=True, use_cache=False)
        for layer, logits in enumerate(out.router_logits):
            chosen = torch.topk(logits, k, dim=-1).indices.flatten()
            counts[layer] += torch.bincount(chosen, minlength=experts).float()
    rows = []
    for layer, row in enumerate(counts):
        share = row / row.sum()
        entropy = float(-(share * share.clamp_min(1e-12).log()).sum() / math.log(experts))
        rows.append({"layer": layer, "share": [round(float(s), 4) for s in share], "entropy": round(entropy, 4)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=SHARED / "models" / "ref-llama")
    parser.add_argument("--train", type=Path, default=SHARED / "corpus" / "calib.jsonl")
    parser.add_argument("--valid", type=Path, default=SHARED / "corpus" / "valid.jsonl")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ref-moe")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--expert-width", type=int, default=192)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--shared-width", type=int, default=0, help="a Qwen2-MoE with a shared expert this wide")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    console = Console()
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dense = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    valid = batches_of(
        token_windows(load_records({"path": "json", "data_files": str(args.valid)}), tokenizer, 512, 64), 8
    )
    windows = token_windows(
        load_records({"path": "json", "data_files": str(args.train)}), tokenizer, args.seq_len, args.steps * args.batch
    )
    dense_ppl = held_out_ppl(dense, valid)
    config = moe_config(dense.config, args.experts, args.expert_width, args.top_k, args.shared_width)
    model = upcycle(dense, config, windows[: args.batch], args.seed)
    del dense
    upcycled_ppl = held_out_ppl(model, valid)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
    )
    model.train()
    started, losses = time.perf_counter(), []
    with Progress(console=console) as progress:
        task = progress.add_task("training the reference MoE", total=args.steps)
        for batch in windows.split(args.batch):
            out = model(input_ids=batch, labels=batch, use_cache=False, output_router_logits=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            lm = float(out.loss) - config.router_aux_loss_coef * float(out.aux_loss)
            losses.append(lm)
            progress.update(task, advance=1, description=f"training the reference MoE (loss {lm:.3f})")
    train_s = time.perf_counter() - started
    trained_ppl = held_out_ppl(model, valid)

    if args.out.exists():
        shutil.rmtree(args.out)
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    for extra in ("chat_template.jinja", "generation_config.json"):
        if (args.model / extra).exists() and not (args.out / extra).exists():
            shutil.copy(args.model / extra, args.out / extra)
    reloaded = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    load = expert_load(reloaded, valid)
    result = {
        "source": str(args.model),
        "experts": args.experts,
        "expert_width": args.expert_width,
        "top_k": args.top_k,
        "shared_width": args.shared_width,
        "steps": args.steps,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "train_s": round(train_s, 1),
        "params": {
            "dense": parameter_count(AutoModelForCausalLM.from_pretrained(args.model)),
            "moe": parameter_count(reloaded),
        },
        "valid_ppl": {
            "dense_source": dense_ppl,
            "upcycled_before_training": upcycled_ppl,
            "trained": trained_ppl,
            "reloaded_bf16": held_out_ppl(reloaded, valid),
        },
        "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
        "expert_load_valid": load,
        "min_expert_share": min(min(row["share"]) for row in load),
        "max_expert_share": max(max(row["share"]) for row in load),
    }
    (args.out / "derivation.json").write_text(json.dumps(result, indent=2) + "\n")
    console.print_json(json.dumps(result))


if __name__ == "__main__":
    main()
