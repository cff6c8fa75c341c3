"""GroupedMMExperts (two grouped matmuls) against the SequentialMLP loop it replaces, on the same
module and weights; the model-level checks (Hugging Face logits, packed = replicated, the planner's
exact split) run Qwen3-MoE through it too."""
import pytest
import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_dualkv.mcore.experts import GroupedMMExperts, back_to_back_view, stacked, store_back_to_back
from megatron_dualkv.models import build_model
from rollouts import device_of


def first_experts():
    model = build_model("qwen3-moe-tiny")
    modules = [m for m in model.modules() if isinstance(m, SequentialMLP)]
    assert modules and all(type(m) is GroupedMMExperts for m in modules)
    return modules[0]


@pytest.fixture(scope="module")
def experts():
    return first_experts()


def run(forward, module, x, tokens_per_expert, probs, dy):
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out, bias = forward(module, x, tokens_per_expert, probs)
    assert bias is None
    out.backward(dy)
    return [out, x.grad] + [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("tokens_per_expert", [[3, 0, 5, 1, 0, 7, 2, 4], [0, 0, 0, 9, 0, 0, 0, 0], [1] * 8])
def test_grouped_matmuls_equal_the_loop_over_experts(experts, tokens_per_expert):
    device = device_of(experts)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    experts.to(dtype)  # on CUDA a cast: each weight gets its own storage again
    for linear in ("linear_fc1", "linear_fc2"):
        weights = experts.expert_weights(linear)
        store_back_to_back(weights)
        assert back_to_back_view(weights) is not None  # the grouped matmuls read the weights in place
    g = torch.Generator().manual_seed(sum(tokens_per_expert))
    n, hidden = sum(tokens_per_expert), experts.config.hidden_size
    x = torch.randn(n, hidden, generator=g).to(device, dtype)
    probs = torch.rand(n, generator=g).to(device)
    dy = torch.randn(n, hidden, generator=g).to(device, dtype)
    counts = torch.tensor(tokens_per_expert)
    assert experts._grouped_path_applies(x)
    grouped = run(GroupedMMExperts.forward, experts, x, counts, probs, dy)
    loop = run(SequentialMLP.forward, experts, x, counts, probs, dy)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, want in zip(grouped, loop):
        torch.testing.assert_close(got, want, **tol)
    experts.float()


def test_the_loop_runs_where_grouped_matmuls_do_not_apply(experts, monkeypatch):
    x = torch.randn(4, experts.config.hidden_size, device=device_of(experts))
    monkeypatch.setattr(experts.config, "activation_func_clamp_value", 1.0, raising=False)
    assert not experts._grouped_path_applies(x)
    monkeypatch.undo()
    assert not experts._grouped_path_applies(x[:, :-1])  # rows of 63 floats: not 16-byte aligned
    calls = []
    monkeypatch.setattr(SequentialMLP, "forward", lambda self, *args: calls.append(args) or (args[0], None))
    monkeypatch.setattr(experts.config, "add_bias_linear", True)
    experts(x, torch.tensor([4, 0, 0, 0, 0, 0, 0, 0]), torch.ones(4, device=x.device))
    assert len(calls) == 1


def test_expert_weights_lie_back_to_back_and_are_read_in_place():
    """One storage per expert linear, so the grouped matmuls take a view of all the experts'
    weights; an update of one expert's weight (an optimizer step) shows through it. (A model of
    its own: the module-scoped one is cast by the tests above, which on CUDA moves each weight.)"""
    experts = first_experts()
    for linear in ("linear_fc1", "linear_fc2"):
        weights = experts.expert_weights(linear)
        view = back_to_back_view(weights)
        assert view is not None and view.data_ptr() == weights[0].data_ptr()
        assert torch.equal(view, torch.stack(weights))
        with torch.no_grad():
            weights[3].add_(1.0)
            assert torch.equal(view[3], weights[3])
            weights[3].sub_(1.0)


def test_weights_moved_apart_are_stacked_as_a_copy():
    base = torch.arange(4 * 6, dtype=torch.float32).view(4, 2, 3)
    weights = [torch.nn.Parameter(t) for t in base.unbind(0)]
    assert back_to_back_view(weights) is not None
    for apart in (weights[::-1], weights[:2] + [torch.nn.Parameter(weights[2].detach().clone())] + weights[3:],
                  [torch.nn.Parameter(base[e].t()) for e in range(4)]):
        assert back_to_back_view(apart) is None
        assert torch.equal(stacked(apart), torch.stack(apart))
    store_back_to_back(weights[::-1])  # a new storage, now in this order
    assert back_to_back_view(weights[::-1]) is not None and torch.equal(stacked(weights[::-1]), base.flip(0))
