"""PACI updates weights in place while older microbatches' graphs still hold them.

The backward must then run on the *current* weights (PACI's semantics), with no copy of any
weight kept, and stock PyTorch must not raise "modified by an inplace operation".
"""

import pytest
import torch

from megatron.pipeline.accounting import SavedTensorMeter, preserve_versions


def make_layer():
    torch.manual_seed(0)
    layer = torch.nn.Linear(5, 3, bias=False)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    return layer, optimizer


def test_backward_after_step_uses_current_weights_by_hand():
    layer, optimizer = make_layer()
    x_old = torch.randn(4, 5, requires_grad=True)  # a microbatch still in flight
    y_old = layer(x_old)
    w_forward = layer.weight.detach().clone()

    # Another microbatch's gradient triggers a step while x_old's graph is alive.
    x_other = torch.randn(4, 5)
    layer(x_other).pow(2).sum().backward()
    with preserve_versions(layer.parameters()):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    w_current = layer.weight.detach()
    assert not torch.equal(w_current, w_forward)

    grad_output = torch.randn(4, 3)
    y_old.backward(grad_output)
    # y = x W^T, so dL/dx = g W: computed by hand with the weights at backward time.
    assert torch.allclose(x_old.grad, grad_output @ w_current, atol=1e-6)
    assert not torch.allclose(x_old.grad, grad_output @ w_forward, atol=1e-3)
    # The weight gradient only needs the saved input: g^T x.
    assert torch.allclose(layer.weight.grad, grad_output.T @ x_old.detach(), atol=1e-6)


def test_without_version_preservation_stock_autograd_refuses():
    layer, optimizer = make_layer()
    y_old = layer(torch.randn(4, 5, requires_grad=True))
    layer(torch.randn(4, 5)).sum().backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match="inplace operation"):
        y_old.sum().backward()


def test_graph_saves_the_parameter_itself_not_a_copy():
    layer, _ = make_layer()
    saved_pointers = []

    def pack(tensor):
        saved_pointers.append(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(torch.randn(4, 5, requires_grad=True))
    assert layer.weight.untyped_storage().data_ptr() in saved_pointers


def test_saved_tensor_meter_counts_activations_not_parameters():
    layer, _ = make_layer()
    meter = SavedTensorMeter(layer.parameters())
    x = torch.randn(8, 5, requires_grad=True)
    with meter.measure() as saved:
        torch.tanh(layer(x))
    # Saved: x (for the weight grad) and tanh's output; the weight itself is excluded.
    expected = x.numel() * 4 + 8 * 3 * 4
    assert saved[0] == expected
