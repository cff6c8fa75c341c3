"""GatheredPermutationMoELayer against Megatron's MoELayer it subclasses: the same module and
weights, with and without the gathers and sums over top-k (the token permutation's backward, the
combine of the expert outputs)."""
import functools

import pytest
import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, unpermute
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_dualkv.mcore import moe_layer
from megatron_dualkv.mcore.moe_layer import GatheredPermutationMoELayer, _CombinedByGather, _PermutedWithGatheredGrad
from megatron_dualkv.models import build_model
from megatron_dualkv.ops.row_gather_sum import row_gather_sum
from rollouts import device_of


def megatron_writes_module_specs() -> bool:  # 0.16; 0.17+ write functools.partial entries
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return isinstance(get_gpt_layer_local_spec(num_experts=8).submodules.mlp, ModuleSpec)


@pytest.fixture(scope="module")
def layer():
    model = build_model("qwen3-moe-tiny")
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if megatron_writes_module_specs():
        assert all(type(m) is MoELayer for m in layers)
        pytest.skip("Megatron-Core 0.16: the spec keeps MoELayer (moe_layer.py's docstring)")
    assert layers and all(type(m) is GatheredPermutationMoELayer for m in layers)
    return layers[0]


def forward_backward(layer, x, dy):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    out.backward(dy)
    return [out.detach(), x.grad] + [p.grad.clone() for p in layer.parameters() if p.grad is not None]


def inputs(layer, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(37, 1, layer.config.hidden_size, generator=g).to(device_of(layer))  # (tokens, batch, hidden)
    return x, torch.randn(x.shape, generator=g).to(x.device)


def record_row_gather_sums(monkeypatch):
    """The shapes of the rows the layer's gathers sum, in call order."""
    calls = []
    monkeypatch.setattr(moe_layer, "row_gather_sum", lambda x, order, k: calls.append(tuple(x.shape)) or row_gather_sum(x, order, k))
    return calls


def as_megatron(monkeypatch):
    monkeypatch.setattr(GatheredPermutationMoELayer, "_gathered_applies", lambda self: False)


def test_outputs_and_gradients_equal_megatrons(layer, monkeypatch):
    # the router's aux-loss backward leaves a scale in this class attribute, which Megatron's
    # schedule (the later tests') expects to set itself
    monkeypatch.setattr(MoEAuxLossAutoScaler, "main_loss_backward_scale", None)
    x, dy = inputs(layer)
    calls = record_row_gather_sums(monkeypatch)
    gathered = forward_backward(layer, x, dy)
    rows = (37 * layer.config.moe_router_topk, layer.config.hidden_size)
    assert calls == [rows, rows]  # the combine, then the permutation's gradient
    as_megatron(monkeypatch)
    megatron = forward_backward(layer, x, dy)
    assert len(calls) == 2
    assert len(gathered) == len(megatron) > 3  # output, input and at least the router's and experts' grads
    for got, want in zip(gathered, megatron):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_no_grad_forward_equals_megatrons(layer, monkeypatch):
    """The combine also runs without autograd (a behaviour policy's log-prob pass)."""
    x, _ = inputs(layer, seed=1)
    calls = record_row_gather_sums(monkeypatch)
    with torch.no_grad():
        gathered, _ = layer(x)
        assert calls == [(37 * layer.config.moe_router_topk, layer.config.hidden_size)]
        as_megatron(monkeypatch)
        megatron, _ = layer(x)
    torch.testing.assert_close(gathered, megatron, rtol=1e-5, atol=1e-6)


def test_not_taken_where_the_input_feeds_more_than_the_permutation(layer, monkeypatch):
    assert layer._gathered_applies()
    monkeypatch.setattr(layer, "shared_experts", torch.nn.Identity())
    assert not layer._gathered_applies()
    monkeypatch.undo()
    for field, value in [("moe_permute_fusion", True), ("moe_expert_capacity_factor", 1.0)]:
        monkeypatch.setattr(layer.config, field, value)
        assert not layer._gathered_applies(), field
        monkeypatch.undo()


@pytest.mark.parametrize("index", [[2, 0, 1, 0, 1, 2], [2, 0, 0, 1]], ids=["k rows each", "uneven: index_add_"])
def test_permutation_gradient_sums_each_tokens_rows(index):
    tokens = torch.randn(3, 1, 5, dtype=torch.float64, requires_grad=True)
    index = torch.tensor(index)
    order = torch.argsort(index, stable=True) if len(index) == 6 else None
    permuted = tokens.detach().view(3, 5).index_select(0, index)
    grad = torch.randn(len(index), 5, dtype=torch.float64)
    _PermutedWithGatheredGrad.apply(tokens, permuted, index, order, 2).backward(grad)
    want = torch.zeros(3, 5, dtype=torch.float64).index_add_(0, index, grad).view(3, 1, 5)
    torch.testing.assert_close(tokens.grad, want)


def test_combine_and_its_gradient_equal_megatrons_unpermute():
    index = torch.tensor([2, 0, 1, 0, 1, 2])  # the token of each row in expert order
    rows = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(3, 5, dtype=torch.float64)
    got = _CombinedByGather.apply(rows, torch.argsort(index, stable=True), index, 2)
    want = unpermute(rows, index, restore_shape=torch.Size((3, 5)))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(*(torch.autograd.grad(y, rows, dy)[0] for y in (got, want)))


def test_spec_swaps_only_megatrons_moe_layer_in_partial_entries():
    submodules = object()
    swapped = moe_layer.with_gathered_permutation(functools.partial(MoELayer, submodules=submodules))
    assert swapped.func is GatheredPermutationMoELayer and swapped.keywords == {"submodules": submodules}
    for unchanged in (functools.partial(torch.nn.Linear, 2, 3), ModuleSpec(module=MoELayer)):
        assert moe_layer.with_gathered_permutation(unchanged) is unchanged
