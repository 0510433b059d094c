"""--defer-embedding-wgrad-compute: the output layer's deferred weight gradient, once drained,
equals the one its backward computes at once (megatron-core's ColumnParallelLinear, one rank)."""

from types import SimpleNamespace

import pytest
import torch

from megatron.pipeline.deferred_wgrad import (
    DeferredWeightGradients,
    defer_output_layer_weight_gradient,
    deferral_report,
    drained_before,
)

HIDDEN, VOCAB, MICROBATCHES = 8, 12, 4


def _output_layer(seed: int = 0):
    """A last stage's output layer: megatron-core's ColumnParallelLinear inside a stand-in for
    GPTModel (`output_layer`, `post_process`)."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    torch.manual_seed(seed)
    config = ModelParallelConfig(use_cpu_initialization=True, perform_initialization=True)
    layer = ColumnParallelLinear(HIDDEN, VOCAB, config=config, init_method=torch.nn.init.normal_,
                                 bias=False, gather_output=False)  # fmt: skip
    model = torch.nn.Module()
    model.output_layer, model.post_process = layer, True
    return model


def _microbatches(seed: int = 1):
    torch.manual_seed(seed)
    return [(torch.randn(3, 2, HIDDEN), torch.randn(3, 2, VOCAB)) for _ in range(MICROBATCHES)]


def _forward_backward(model, microbatches, weight=None) -> list[torch.Tensor]:
    """Forward then backward of each microbatch, 1F1B-like (two forwards ahead); the input
    gradients."""
    outputs, grads = [], []
    for hidden, target in microbatches:
        hidden = hidden.clone().requires_grad_()
        logits, _ = model.output_layer(hidden, weight=weight)
        outputs.append((hidden, (logits * target).sum()))
    for hidden, loss in outputs:
        loss.backward()
        grads.append(hidden.grad)
    return grads


@pytest.mark.parametrize("limit", [0, 2])
def test_drained_weight_gradient_equals_the_immediate_one(one_rank_group, limit):
    immediate, deferring = _output_layer(), _output_layer()
    deferred = defer_output_layer_weight_gradient(deferring, limit)
    microbatches = _microbatches()
    expected_input_grads = _forward_backward(immediate, microbatches)
    input_grads = _forward_backward(deferring, microbatches)
    for got, expected in zip(input_grads, expected_input_grads):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    weight, expected = deferring.output_layer.weight, immediate.output_layer.weight.grad
    assert len(deferred.kept) == (limit or MICROBATCHES)
    if limit == 0:
        assert weight.grad is None  # nothing computed before the drain
    else:  # the microbatches past the limit computed theirs in their backward
        assert not torch.allclose(weight.grad, expected)
    deferred.drain()
    assert deferred.kept == [] and deferred.deferred == 0
    torch.testing.assert_close(weight.grad, expected, rtol=1e-6, atol=1e-6)
    kept_bytes = (limit or MICROBATCHES) * 3 * 2 * (HIDDEN + VOCAB) * 4
    assert deferral_report(deferring) == {"microbatches": limit or MICROBATCHES,
                                          "peak_kept": limit or MICROBATCHES,
                                          "peak_kept_bytes": kept_bytes}  # fmt: skip


def test_a_tied_weight_receives_the_drained_gradient_through_its_hooks(one_rank_group):
    """The output layer given the embedding's weight (tied): the drained gradient lands in that
    parameter's .grad and runs its post-accumulate hooks (fp32 main_grad) once per microbatch."""
    model = _output_layer()
    defer_output_layer_weight_gradient(model, 0)
    torch.manual_seed(2)
    embedding = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN))
    reference = embedding.detach().clone().requires_grad_()
    accumulations = []
    embedding.register_post_accumulate_grad_hook(lambda p: accumulations.append(p.grad.clone()))
    microbatches = _microbatches()
    _forward_backward(model, microbatches, weight=embedding)
    for hidden, target in microbatches:
        (torch.matmul(hidden, reference.t()) * target).sum().backward()
    assert embedding.grad is None and model.output_layer.weight.grad is None
    step = drained_before(lambda: embedding.grad.clone(), model)
    torch.testing.assert_close(step(), reference.grad, rtol=1e-6, atol=1e-6)
    assert len(accumulations) == MICROBATCHES
    assert model.output_layer.weight.grad is None  # the layer's own weight is not the tied one


def test_no_deferral_without_gradients_or_past_the_limit(one_rank_group):
    model = _output_layer()
    deferred = defer_output_layer_weight_gradient(model, 1)
    hidden = torch.randn(3, 2, HIDDEN)
    with torch.no_grad():  # evaluation reserves nothing
        model.output_layer(hidden)
    assert deferred.deferred == 0
    _forward_backward(model, _microbatches()[:2])
    assert deferred.deferred == 1 and len(deferred.kept) == 1
    assert drained_before(None, model) is None
    with pytest.raises(ValueError, match=">= 0"):
        DeferredWeightGradients(-1)


def test_only_a_last_stage_defers():
    stage = SimpleNamespace(output_layer=None, post_process=False)
    assert defer_output_layer_weight_gradient(stage, 0) is None


def test_a_microbatch_forwarded_before_a_step_is_drained_into_the_step_after_its_backward(
    one_rank_group,
):
    """PACI's order on a stage: a microbatch forwarded before the stage's step and run backward
    after it. Its weight gradient belongs to the step after its backward (there the immediate
    backward puts it): the drain before the first step has nothing of it, the one before the
    second step has it; with limit 1 it holds the count until then, so the next forward
    computes its weight gradient at once."""
    immediate, deferring = _output_layer(), _output_layer()
    deferred = defer_output_layer_weight_gradient(deferring, 1)
    (first, first_target), (second, second_target) = _microbatches()[:2]
    grads_at_steps = {id(immediate): [], id(deferring): []}
    for model in (immediate, deferring):
        weight = model.output_layer.weight
        step = drained_before(lambda w=weight, m=model: grads_at_steps[id(m)].append(
            None if w.grad is None else w.grad.clone()), model)  # fmt: skip
        early, _ = model.output_layer(first.clone().requires_grad_())
        step()  # the stage steps while the first microbatch is in flight
        weight.grad = None  # the step's zero_grad
        late, _ = model.output_layer(second.clone().requires_grad_())
        (early * first_target).sum().backward()
        (late * second_target).sum().backward()
        step()
    (before, after), (deferred_before, deferred_after) = grads_at_steps.values()
    assert before is None and deferred_before is None
    torch.testing.assert_close(deferred_after, after, rtol=1e-6, atol=1e-6)
    assert deferral_report(deferring)["microbatches"] == 1 and deferred.deferred == 0
