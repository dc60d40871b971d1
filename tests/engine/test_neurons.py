"""The MLP's width as a pruning axis (`engine.neurons`, issue 34): keeping every neuron gives the
model back, the refit is the least-squares solution, each selector does what it says (a third
party's too), the pruned model saves as the original class with a smaller MLP, bad input is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from compressor.engine.calibration import capture_layer_inputs, counted_rows
from compressor.engine.neurons import MlpOptions, RefitTarget, mlp_linears, output_error, prune_mlp, refit_down
from compressor.errors import UserError
from compressor.models.families import family_for
from compressor.plugin import NeuronChoice, NeuronProblem, NeuronSelector, hookimpl
from compressor.strategies.registry import PluginRegistry
from tests.conftest import copy_model, max_relative_logit_error, random_batches, tiny_model

SELECTORS = ("magnitude", "leverage", "obs")


def _selector(name: str) -> NeuronSelector:
    return PluginRegistry().selector(name)


@pytest.mark.parametrize("family_name", ["llama", "phi3", "gemma2", "opt", "gpt2", "phi"])
@pytest.mark.parametrize("selector", SELECTORS)
def test_keeping_every_neuron_gives_the_model_back(family_name: str, selector: str) -> None:
    """S = all neurons, refitted with the default damping: the logits to float round-off (gated,
    fused gate_up, plain fc1/fc2 MLPs, Conv1D turned Linear, a parallel block)."""
    original = tiny_model(family_name)
    family = family_for(family_name)
    model = copy_model(original)
    if family.prepare is not None:
        family.prepare(model)
    width = mlp_linears(model.get_submodule(family.layers)[0], family)[1].in_features
    batches = random_batches(original.config.vocab_size, padded=True)
    records = prune_mlp(model, family, batches, width, MlpOptions(_selector(selector)))
    assert [r.kept for r in records] == [width] * original.config.num_hidden_layers
    assert {r.feedback for r in records} == {0.0 if family.mlp_post_norm else 0.5}
    assert all(r.error_refit is not None and abs(r.error_refit) < 1e-9 for r in records)
    assert max_relative_logit_error(original, model, batches) < 1e-5


def test_the_refit_is_the_least_squares_solution() -> None:
    """Undamped, W' = W·C[:,S]·C[S,S]⁻¹ is lstsq(h_S, h·Wᵀ) on the tokens C was measured on; the
    damped one lies between it and the kept weights, and the output error of each is what
    `output_error` predicts from C."""
    generator = torch.Generator().manual_seed(0)
    tokens, f, d = 400, 12, 5
    h = torch.randn(tokens, f, generator=generator, dtype=torch.float64) @ torch.randn(
        f, f, generator=generator, dtype=torch.float64
    )
    W = torch.randn(d, f, generator=generator, dtype=torch.float64)
    C = h.T @ h / tokens
    kept = torch.tensor([0, 2, 3, 5, 7, 8, 11])
    refit = refit_down(W, C, kept, 0.0)
    expected = torch.linalg.lstsq(h[:, kept], h @ W.T).solution.T
    assert torch.allclose(refit, expected, atol=1e-10)
    target = RefitTarget.output(W, C)
    measured = ((h @ W.T - h[:, kept] @ refit.T) ** 2).sum() / ((h @ W.T) ** 2).sum()
    assert output_error(target, C, kept, refit) == pytest.approx(float(measured), rel=1e-9)
    plain = output_error(target, C, kept, W[:, kept])
    damped = output_error(target, C, kept, refit_down(W, C, kept, 1e-1))
    assert output_error(target, C, kept, refit) < damped < plain
    assert torch.allclose(target.full_map(W, C, 1e-1), W, atol=1e-10)  # the output target's full map is W


def test_the_full_map_refitted_is_the_damped_fit_of_any_target() -> None:
    """For a target t other than W h, refitting W* = (X + δW)(C + δI)⁻¹ to the kept neurons is
    the ridge solution min E‖t − W' h_S‖² + δ‖W' − W[:,S]‖², and `output_error` measures it."""
    generator = torch.Generator().manual_seed(1)
    tokens, f, d, delta = 500, 10, 4, 0.05
    h = torch.randn(tokens, f, generator=generator, dtype=torch.float64)
    W = torch.randn(d, f, generator=generator, dtype=torch.float64)
    t = h @ W.T + 0.3 * torch.randn(tokens, d, generator=generator, dtype=torch.float64) + h[:, :d] * 0.5
    C = h.T @ h / tokens
    target = RefitTarget(t.T @ h / tokens, float((t * t).sum()) / tokens)
    kept = torch.tensor([1, 2, 4, 6, 9])
    refit = refit_down(target.full_map(W, C, delta), C, kept, delta)
    stacked = torch.cat([h[:, kept] / tokens**0.5, delta**0.5 * torch.eye(len(kept), dtype=torch.float64)])
    goal = torch.cat([t / tokens**0.5, delta**0.5 * W[:, kept].T])
    assert torch.allclose(refit, torch.linalg.lstsq(stacked, goal).solution.T, atol=1e-10)
    measured = ((t - h[:, kept] @ refit.T) ** 2).sum() / (t * t).sum()
    assert output_error(target, C, kept, refit) == pytest.approx(float(measured), rel=1e-9)


@pytest.mark.parametrize("feedback", [1.0, 0.5])
def test_error_feedback_fits_a_share_of_the_stream_the_layer_wrote_before(feedback: float) -> None:
    """With feedback α, the second layer's down projection is the least-squares map from its kept
    neurons (on the stream the pruned first layer wrote) to what it wrote plus α times the
    difference between the unpruned layer's output on the original stream and on the pruned one;
    without feedback the first layer is the same and the second differs."""
    family = family_for("llama")
    original = tiny_model("llama")
    model = copy_model(original)
    batches = random_batches(original.config.vocab_size, padded=True)
    keep = original.config.intermediate_size // 2
    prune_mlp(model, family, batches, keep, MlpOptions(_selector("magnitude"), damping=1e-12, feedback=feedback))
    first, second = model.model.layers
    unpruned = original.model.layers[1]
    inputs = capture_layer_inputs(original, family, batches, torch.device("cpu"))
    rows_h, rows_t = [], []
    seen: dict[str, torch.Tensor] = {}
    handle = unpruned.mlp.down_proj.register_forward_pre_hook(lambda _, args: seen.update(h=args[0]))
    with torch.no_grad():
        for b in range(len(inputs)):
            kwargs = [inputs.kwargs(b, i, torch.device("cpu")) for i in (0, 1)]
            x = inputs.hidden.get(b)
            reference = unpruned(original.model.layers[0](x, **kwargs[0]), **kwargs[1])
            pruned_stream = first(x, **kwargs[0])
            out = unpruned(pruned_stream, **kwargs[1])
            h = seen["h"]
            t = h @ unpruned.mlp.down_proj.weight.T + feedback * (reference - out)
            mask = inputs.token_masks[b]
            rows_h.append(counted_rows(h, mask).double())
            rows_t.append(counted_rows(t, mask).double())
    handle.remove()
    h, t = torch.cat(rows_h), torch.cat(rows_t)
    gate = unpruned.mlp.gate_proj.weight
    kept = [int(torch.nonzero((gate == row).all(1))[0]) for row in second.mlp.gate_proj.weight]
    expected = torch.linalg.lstsq(h[:, kept], t).solution.T
    assert torch.allclose(second.mlp.down_proj.weight.double(), expected, rtol=1e-4, atol=1e-5)
    output_target = copy_model(original)
    prune_mlp(output_target, family, batches, keep, MlpOptions(_selector("magnitude"), damping=1e-12, feedback=0.0))
    assert not torch.allclose(output_target.model.layers[1].mlp.down_proj.weight, second.mlp.down_proj.weight)
    assert torch.allclose(output_target.model.layers[0].mlp.down_proj.weight, first.mlp.down_proj.weight, atol=1e-6)


def _problem(h: torch.Tensor, keep: int, W: torch.Tensor | None = None) -> NeuronProblem:
    C = h.T @ h / h.shape[0]
    f = h.shape[1]
    down = W if W is not None else torch.eye(f, dtype=torch.float64)[:3]
    return NeuronProblem(layer=0, keep=keep, C=C, activation=h.abs().mean(0), down=down, damping=1e-8)


def test_magnitude_keeps_the_loudest_neurons_and_leverage_the_independent_ones() -> None:
    """Neuron 1 is loud but a copy of neuron 0: magnitude keeps both, leverage (each carries half of
    a one-dimensional span) keeps the quieter independent neurons before it."""
    generator = torch.Generator().manual_seed(1)
    base = torch.randn(500, 4, generator=generator, dtype=torch.float64)
    h = torch.stack([5 * base[:, 0], 5 * base[:, 0], base[:, 1], base[:, 2], 0.5 * base[:, 3]], dim=1)
    assert _selector("magnitude").select(_problem(h, 2)).kept.tolist() == [0, 1]
    assert sorted(_selector("leverage").select(_problem(h, 3)).kept.tolist()) == [2, 3, 4]


def test_obs_drops_a_redundant_neuron_at_no_cost_and_weighs_the_output() -> None:
    """A neuron that copies another costs nothing to remove once the copy writes for both; with an
    output sensitivity G that ignores what neuron 3 writes, obs removes neuron 3 first."""
    generator = torch.Generator().manual_seed(2)
    base = torch.randn(600, 4, generator=generator, dtype=torch.float64)
    h = torch.cat([base, base[:, :1]], dim=1)  # neuron 4 = neuron 0
    W = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    problem = _problem(h, 4, W)
    choice = _selector("obs").select(problem)
    kept = choice.kept
    assert len(set(kept.tolist()) & {0, 4}) == 1 and choice.objectives["predicted_loss"] < 1e-6
    assert (
        output_error(RefitTarget.output(W, problem.C), problem.C, kept, refit_down(W, problem.C, kept, problem.damping))
        < 1e-6
    )
    W_local = torch.zeros(3, 4, dtype=torch.float64)
    W_local[:, :3] = torch.randn(3, 3, generator=generator, dtype=torch.float64)
    W_local[2, 3] = 10.0  # neuron 3 writes only to coordinate 2 of the stream...
    G = torch.diag(torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64))  # ...which the output ignores
    independent = NeuronProblem(0, 3, base.T @ base / 600, base.abs().mean(0), W_local, 1e-8, G=G)
    assert _selector("obs").select(independent).kept.tolist() == [0, 1, 2]


class _EveryOther(NeuronSelector):
    name = "every-other"
    description = "a third party's selector: the even neurons"

    def select(self, problem: NeuronProblem) -> NeuronChoice:
        return NeuronChoice(torch.arange(0, 2 * problem.keep, 2))


class _Plugin:
    @hookimpl
    def compressor_neuron_selectors(self) -> list[NeuronSelector]:
        return [_EveryOther()]


def test_a_third_party_selector_registers_and_prunes() -> None:
    registry = PluginRegistry(extra_plugins=[_Plugin()])
    assert registry.selectors()["every-other"].plugin != "neurons"
    family = family_for("llama")
    model = tiny_model("llama")
    before = [mlp_linears(layer, family)[0][0].weight.clone() for layer in model.model.layers]
    width = before[0].shape[0]
    prune_mlp(
        model, family, random_batches(model.config.vocab_size), width // 2, MlpOptions(registry.selector("every-other"))
    )
    for layer, weight in zip(model.model.layers, before):
        assert torch.equal(mlp_linears(layer, family)[0][0].weight, weight[::2])


@pytest.mark.parametrize("refit", [True, False])
def test_a_pruned_mlp_saves_as_the_original_class(refit: bool, tmp_path: Path) -> None:
    """Half the neurons, `intermediate_size` set to what is kept: plain transformers loads the folder
    (the original class, no remote code) and gives the pruned model's logits; the refit's output
    error is below the plain drop's at every layer."""
    family = family_for("llama")
    original = tiny_model("llama")
    model = copy_model(original)
    batches = random_batches(model.config.vocab_size, padded=True)
    keep = model.config.intermediate_size // 2
    records = prune_mlp(model, family, batches, keep, MlpOptions(_selector("obs"), refit=refit))
    if refit:
        assert all(r.error_refit is not None and r.error_refit < r.error_dropped for r in records)
    model.config.intermediate_size = keep
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(reloaded) is type(original) and reloaded.config.intermediate_size == keep
    assert sum(p.numel() for p in reloaded.parameters()) < sum(p.numel() for p in original.parameters())
    assert max_relative_logit_error(model, reloaded, batches) == 0.0


class _Wrong(NeuronSelector):
    name = "wrong"

    def select(self, problem: NeuronProblem) -> NeuronChoice:
        return NeuronChoice(torch.zeros(problem.keep, dtype=torch.long))


def test_bad_input_is_one_line() -> None:
    family = family_for("llama")
    model = tiny_model("llama")
    batches = random_batches(model.config.vocab_size)
    width = model.config.intermediate_size
    with pytest.raises(UserError, match=f"cannot keep {width + 1} of the {width} neurons"):
        prune_mlp(model, family, batches, width + 1, MlpOptions(_selector("magnitude")))
    with pytest.raises(UserError, match="'wrong' at layer 0 returned 1 distinct neurons; it must return 8"):
        prune_mlp(model, family, batches, 8, MlpOptions(_Wrong()))
    with pytest.raises(UserError, match="unknown neuron selector 'magnitud' \\(did you mean 'magnitude'\\?\\)"):
        PluginRegistry().selector("magnitud")
    with pytest.raises(UserError, match="needs the output sensitivity H"):
        prune_mlp(
            model, family, batches, 8, MlpOptions(type("NeedsH", (_Wrong,), {"name": "needs-h", "requires": ("H",)})())
        )
    with pytest.raises(UserError, match="mlp.feedback 1.5: give a share of the stream's error from 0 to 1"):
        prune_mlp(model, family, batches, 8, MlpOptions(_selector("magnitude"), feedback=1.5))
