"""Mixture-of-Experts blocks in the form the engine reads: the router and every expert as linears.

transformers 5 stores a sparse MoE block's experts fused (`gate_up_proj [E, 2f, d]`, `down_proj
[E, d, f]`; gpt-oss transposed, gate and up interleaved, with biases) and may run them through
grouped kernels that no per-linear hook sees. `unfuse_experts` (a family's `prepare`) turns each
such block into `RoutedExperts`, whose readers and writers of the stream are `nn.Linear`s the
engine rotates and slices like any other; `fused_experts_state` and `gpt_oss_experts_state` (a
family's `own_state`) stack them back for the family's own class.

This module's source travels with every saved per-site model (`models.export` writes it, before
`models.families`, into `modeling_sliced.py`), so it imports nothing from `compressor`
(`tests/models/test_export.py` checks it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from compressor.errors import UserError


class ClampedSwiGLU(nn.Module):
    """gpt-oss's expert activation of one neuron's gate g and up u: (clamp(u, ±limit) + 1) ·
    g'·σ(α·g') with g' = min(g, limit). Like act(g)·u it is elementwise per neuron, so a neuron is
    still one gate row, one up row and one down column."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, gate: Any, up: Any) -> Any:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


class Expert(nn.Module):
    """One routed expert as linears: gate and up fused (gate rows first, then up rows, whatever the
    family's own order), then the down projection, which writes the stream. Its activation is
    act_fn(gate)·up, or `glu(gate, up)` where the family's differs (gpt-oss's `ClampedSwiGLU`)."""

    def __init__(
        self,
        gate_up_proj: nn.Linear,
        down_proj: nn.Linear,
        act_fn: Callable[[Any], Any],
        glu: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act_fn, self.glu = gate_up_proj, down_proj, act_fn, glu

    def activation(self, hidden_states: Any) -> Any:
        """The intermediate activation h the down projection reads (the expert's neurons)."""
        gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
        return self.glu(gate, up) if self.glu is not None else self.act_fn(gate) * up

    def forward(self, hidden_states: Any) -> Any:
        return self.down_proj(self.activation(hidden_states))


@dataclass(frozen=True)
class Routing:
    """How a MoE block routes a token: to its `top_k` experts by softmax probability, renormalised
    over the k (`normalise`) where the family does so; `paired`: the block returns (output, None)."""

    top_k: int
    normalise: bool
    paired: bool = False


class RoutedExperts(nn.Module):
    """A sparse Mixture-of-Experts block in the form the engine reads (`ModelFamily.prepare` turns a
    family's fused-expert block into it): the router and every expert as `nn.Linear`s, so a change of
    stream basis is absorbed by the router and each expert's input projection (router logits are
    exactly invariant), and by each expert's down projection (the block's output is linear in them).
    Each token goes to its `top_k` experts by softmax probability (renormalised over the k where the
    family does so), weighted by it; a shared expert, where there is one, adds its output gated by
    sigmoid(shared_expert_gate). Every expert runs as its own linears (transformers' eager experts),
    so a hook on an expert sees exactly the tokens routed to it. Its output has its writers' width,
    which may differ from its input's in a sliced model. With `paired`, it returns (output, None),
    as a block whose family's layer unpacks a pair does (gpt-oss returns its router scores too)."""

    def __init__(
        self,
        router: nn.Linear,
        experts: nn.ModuleList,
        routing: Routing,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Linear | None = None,
    ) -> None:
        super().__init__()
        self.router, self.experts, self.top_k, self.normalise = router, experts, routing.top_k, routing.normalise
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate
        self.paired = routing.paired

    def readers(self) -> list[nn.Module]:
        shared = [] if self.shared_expert is None else [self.shared_expert.gate_proj, self.shared_expert.up_proj]
        gate = [] if self.shared_expert_gate is None else [self.shared_expert_gate]
        return [self.router, *(expert.gate_up_proj for expert in self.experts), *shared, *gate]

    def writers(self) -> list[nn.Module]:
        shared = [] if self.shared_expert is None else [self.shared_expert.down_proj]
        return [*(expert.down_proj for expert in self.experts), *shared]

    def keep_experts(self, kept: Any) -> None:
        """Keep only the experts `kept` (indices, ascending), in place: the router loses the others'
        rows, so each token re-picks its top-k among those left, its weights renormalised as the
        family's router does (a stock model with fewer experts computes the same)."""
        rows = torch.as_tensor(kept, dtype=torch.long)
        router = self.router
        router.weight = nn.Parameter(router.weight.data[rows.to(router.weight.device)].clone(), requires_grad=False)
        if router.bias is not None:
            router.bias = nn.Parameter(router.bias.data[rows.to(router.bias.device)].clone(), requires_grad=False)
        router.out_features = len(rows)
        self.experts = nn.ModuleList(self.experts[int(index)] for index in rows)

    def route(self, hidden_states: Any) -> tuple[Any, Any]:
        """Each token's experts (indices, tokens × top_k) and their weights, as the family's router computes them."""
        logits = self.router(hidden_states)
        probabilities = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probabilities, self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(logits.dtype)

    def dispatch(self, flat: Any) -> Iterator[tuple[int, Any, Any]]:
        """Each expert some token of `flat` (tokens × d) is routed to, in index order: the expert,
        the rows of `flat` sent to it and their routing weights, as `forward` applies them."""
        chosen, weights = self.route(flat)
        for index in torch.unique(chosen).tolist():
            token, position = torch.where(chosen == index)
            yield index, token, weights[token, position]

    def forward(self, hidden_states: Any) -> Any:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        width = self.experts[0].down_proj.out_features
        out = torch.zeros(flat.shape[0], width, dtype=flat.dtype, device=flat.device)
        if _is_fake(flat):  # the memory plan's shapes-only pass: which token goes where is unknown
            self._spread(flat, self.route(flat)[1], out)
        else:
            for index, token, weight in self.dispatch(flat):
                routed = self.experts[index](flat[token]) * weight[:, None]
                out.index_add_(0, token, routed.to(out.dtype))
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        out = out.reshape(*shape[:-1], width)
        return (out, None) if self.paired else out

    def _spread(self, flat: Any, weights: Any, out: Any) -> None:
        """The routed rows spread evenly over the experts (tokens × top_k of them in all, as routing
        gives): what a pass that knows only shapes (fake tensors) can measure memory by."""
        rows = min(flat.shape[0], -(-flat.shape[0] * self.top_k // len(self.experts)))
        token = torch.arange(rows, device=flat.device)
        for expert in self.experts:
            routed = expert(flat[:rows]) * weights[:rows, :1]
            out.index_add_(0, token, routed.to(out.dtype))


def _is_fake(tensor: Any) -> bool:
    """Whether `tensor` has shapes only (a FakeTensor, as the memory plan measures with)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def _linear_like(weight: Any, bias: Any = None) -> nn.Linear:
    """An `nn.Linear` holding `weight` ([out, in]) and `bias` (where given), on its device and in its dtype."""
    linear = nn.Linear(
        weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype
    )
    linear.requires_grad_(False)
    if weight.device.type != "meta":
        linear.weight.data = weight.detach().clone()
        if bias is not None:
            linear.bias.data = bias.detach().clone()
    return linear


def _gate_then_up(rows: Any) -> Any:
    """gpt-oss's interleaved rows (g0, u0, g1, u1, …) as gate rows then up rows."""
    return torch.cat([rows[0::2], rows[1::2]])


def _gpt_oss_experts(block: nn.Module) -> RoutedExperts:
    """gpt-oss's MoE block (router with a bias; `experts.gate_up_proj [E, d, 2f]` transposed with
    gate and up interleaved, `down_proj [E, f, d]`, each with a bias; the clamped SwiGLU) as
    `RoutedExperts`. Its router takes the top-k logits and a softmax over them: the softmax over
    every expert renormalised over the k, which `RoutedExperts.route` computes."""
    fused, router = block.experts, block.router
    glu = ClampedSwiGLU(fused.alpha, fused.limit)
    experts = nn.ModuleList(
        Expert(
            _linear_like(_gate_then_up(fused.gate_up_proj[e].T), _gate_then_up(fused.gate_up_proj_bias[e])),
            _linear_like(fused.down_proj[e].T, fused.down_proj_bias[e]),
            torch.sigmoid,  # unused: glu is the activation
            glu,
        )
        for e in range(fused.gate_up_proj.shape[0])
    )
    routing = Routing(router.top_k, normalise=True, paired=True)
    return RoutedExperts(_linear_like(router.weight, router.bias), experts, routing)


def _routed_experts(block: nn.Module) -> RoutedExperts:
    """A transformers sparse-MoE block (router `gate.weight [E, d]`, fused `experts.gate_up_proj
    [E, 2f, d]` and `experts.down_proj [E, d, f]`, an optional shared expert) as `RoutedExperts`."""
    fused = block.experts
    experts = nn.ModuleList(
        Expert(_linear_like(fused.gate_up_proj[index]), _linear_like(fused.down_proj[index]), fused.act_fn)
        for index in range(fused.gate_up_proj.shape[0])
    )
    router = block.gate
    return RoutedExperts(
        _linear_like(router.weight),
        experts,
        Routing(router.top_k, normalise=getattr(router, "norm_topk_prob", True)),  # Mixtral always renormalises
        shared_expert=getattr(block, "shared_expert", None),
        shared_expert_gate=getattr(block, "shared_expert_gate", None),
    )


def is_fused_experts(module: nn.Module) -> bool:
    """Whether `module` is a transformers MoE block whose experts are fused 3-D tensors."""
    experts = getattr(module, "experts", None)
    fused = getattr(experts, "gate_up_proj", None) if isinstance(experts, nn.Module) else None
    return isinstance(fused, torch.Tensor) and fused.dim() == 3


def unfuse_experts(model: nn.Module) -> None:
    """Every fused-expert MoE block of `model` as `RoutedExperts` (dense layers stay as they are)."""
    for name, module in list(model.named_modules()):
        if is_fused_experts(module):
            if not module.experts.gate_up_proj.is_floating_point():
                raise UserError(
                    f"{name}: its experts are quantized ({module.experts.gate_up_proj.dtype}, e.g. gpt-oss's MXFP4 "
                    f"loaded with its kernels); load the model dequantized (transformers' Mxfp4Config(dequantize=True))"
                )
            gpt_oss = hasattr(module.experts, "gate_up_proj_bias")  # transposed, interleaved, with biases
            model.set_submodule(name, _gpt_oss_experts(module) if gpt_oss else _routed_experts(module))


def fused_experts_state(state: dict[str, Any]) -> dict[str, Any]:
    """A state dict with `RoutedExperts` keys written back in the family's fused form (router
    `gate.weight`, `experts.gate_up_proj [E, 2f, d]`, `experts.down_proj [E, d, f]`), as the
    family's own class loads it (`ModelFamily.own_state`)."""
    out: dict[str, Any] = {}
    stacked: dict[str, dict[int, Any]] = {}
    for key, value in state.items():
        if ".experts." in key and key.endswith((".gate_up_proj.weight", ".down_proj.weight")):
            prefix, rest = key.split(".experts.", 1)
            index, kind, _ = rest.split(".")
            stacked.setdefault(f"{prefix}.experts.{kind}", {})[int(index)] = value
        elif key.endswith(".router.weight"):
            out[key.removesuffix("router.weight") + "gate.weight"] = value
        else:
            out[key] = value
    for key, values in stacked.items():
        out[key] = torch.stack([values[index] for index in sorted(values)])
    return out


def gpt_oss_experts_state(state: dict[str, Any]) -> dict[str, Any]:
    """A state dict with `RoutedExperts` keys in gpt-oss's fused form: `experts.gate_up_proj [E, d,
    2f]` (transposed, gate and up interleaved) and `down_proj [E, f, d]`, each with its `_bias`; the
    router keeps its name and bias."""
    out: dict[str, Any] = {}
    stacked: dict[str, dict[int, Any]] = {}
    for key, value in state.items():
        if ".experts." in key and key.rsplit(".", 2)[-2] in ("gate_up_proj", "down_proj"):
            prefix, rest = key.split(".experts.", 1)
            index, kind, part = rest.split(".")
            if kind == "gate_up_proj":  # gate rows then up rows → g0, u0, g1, u1, …
                value = torch.stack(value.chunk(2, dim=0), dim=1).flatten(0, 1)
            value = value.T if part == "weight" else value
            name = kind if part == "weight" else f"{kind}_bias"
            stacked.setdefault(f"{prefix}.experts.{name}", {})[int(index)] = value
        else:
            out[key] = value
    for key, values in stacked.items():
        out[key] = torch.stack([values[index] for index in sorted(values)])
    return out
