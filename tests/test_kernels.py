"""backends/cpu/onednn.py: oneDNN's float32 linear as an operator that compiled graphs can call with weights as inputs."""

import pytest
import torch

from staticformers.backends.cpu import onednn as kernels

pytestmark = pytest.mark.skipif(not kernels.onednn_available(), reason="this PyTorch has no oneDNN")


@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_matches_f_linear(bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 40, bias=bias)
    x = torch.randn(2, 7, 48)
    with torch.no_grad():
        torch.testing.assert_close(kernels.onednn_linear(layer, x), layer(x), rtol=1e-5, atol=1e-5)
        strided = torch.randn(2, 48, 7).transpose(1, 2)  # not contiguous
        torch.testing.assert_close(kernels.onednn_linear(layer, strided), layer(strided), rtol=1e-5, atol=1e-5)


def test_onednn_linear_traces_with_the_weight_as_a_graph_input():
    layer = torch.nn.Linear(32, 24)
    seen = []

    def backend(gm, example_inputs):
        seen.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    fn = torch.compile(
        lambda x, w, b: torch.ops.staticformers.onednn_linear(x, w, b).relu(), backend=backend, fullgraph=True
    )
    x = torch.randn(3, 32)
    with torch.no_grad():
        out = fn(x, layer.weight, layer.bias)
        torch.testing.assert_close(out, layer(x).relu(), rtol=1e-5, atol=1e-5)
    assert any("onednn_linear" in str(t) for t in seen[0])


def test_onednn_linear_with_a_strided_bias():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 40)
    with torch.no_grad():
        layer.bias = torch.nn.Parameter(torch.randn(80)[::2])  # a view with stride 2
        x = torch.randn(3, 16)
        torch.testing.assert_close(kernels.onednn_linear(layer, x), layer(x), rtol=1e-5, atol=1e-5)


def test_onednn_linear_keeps_gradients_by_falling_back_to_f_linear():
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(2, 16, requires_grad=True)
    kernels.onednn_linear(layer, x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
