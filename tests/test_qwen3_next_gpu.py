"""The hybrid family (Qwen3.5, Qwen3-Next) on a GPU in bf16, on the CUDA paths that the CPU tests do
not run: fla's chunked delta rule where it is usable (else the PyTorch chunked rule), the short
conv's Triton kernels and the Triton attention kernels. A GRPO step's log-probs and every gradient
on the packed layout are within twice the replicated layout's own bf16 error (each trajectory a
sequence from zero state), both against the packed step of the same weights in float64 (which runs
every op's PyTorch math, on the GPU too): on groups with odd lengths and padding, and on a prefix tree."""
import pytest
import torch

from flash_check import assert_within_twice_the_reference_error
from megatron_dualkv import Trajectory, pack_groups, pack_trajectories
from megatron_dualkv.mcore.gated_delta_net import DualKVGatedDeltaNet
from megatron_dualkv.models import build_model
from megatron_dualkv.rl import GRPOLoss, RLMicroBatch, forward_backward, forward_logprobs
from rollouts import make_groups, perturbed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = [[(37, [23, 5, 41]), (9, [17, 30])], [(60, [8]), (13, [29, 3, 44, 11])]]


def bf16_model_and_exact_copy(card):
    """``card`` in bf16 where ``build_model`` puts it, with a slow decay in every Gated DeltaNet
    layer, and the same weights in float64 beside it (every op's exact PyTorch math; on the GPU,
    since Megatron moves a MoE router's weight there whatever the model's device). No
    load-balancing loss: its statistics are per layout.

    The slow decay (about 1% a token): at the initialisation's (up to 16 a token) a state fades
    within a few tokens, and a wrong hand-off between segments would hide under bf16 rounding."""
    model = build_model(card, dtype=torch.bfloat16, moe_aux_loss_coeff=0.0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, DualKVGatedDeltaNet):
                module.A_log.fill_(-4.0)
    exact = build_model(card, moe_aux_loss_coeff=0.0).double()
    exact.load_state_dict({name: value.double() if torch.is_tensor(value) and value.is_floating_point() else value
                           for name, value in model.state_dict().items()})
    return model, exact


def _tree():
    """A 40-token root, two branches under it and one leaf beside them; leaves of odd lengths, one
    trajectory ending where its branch ends; trained after the root."""
    g = torch.Generator().manual_seed(5)
    ids = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    root, left, right = ids(40), ids(17), ids(9)
    paths = [root + left + ids(23), root + left + ids(5), root + right + ids(31), root + right, root + ids(12)]
    return [Trajectory(p, [False] * len(root) + [True] * (len(p) - len(root)), float(i % 2), "a")
            for i, p in enumerate(paths)]


def _batches():
    return ([pack_groups(make_groups(shapes, seed=seed), pad_to_multiple_of=8) for seed, shapes in enumerate(SHAPES)]
            + [pack_trajectories(_tree(), pad_to_multiple_of=8)])


def _step(model, batches, behaviour, layout):
    """(the trained tokens' log-probs, {name: gradient}), in float64 on the CPU."""
    device = next(model.parameters()).device
    moved = [[[x.to(device) for x in group] for group in nested] for nested in behaviour]
    micro_batches = [RLMicroBatch(batch, old, ref) for batch, old, ref in zip(batches, moved[0::2], moved[1::2])]
    model.zero_grad(set_to_none=True)
    outputs = forward_backward(model, micro_batches, GRPOLoss(clip_eps=0.2, kl_coef=0.05), layout=layout)
    logprobs = torch.cat([lp.detach().cpu().double() for out in outputs for group in out.logprobs for lp in group])
    grads = {name: p.grad.cpu().double() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logprobs, grads


@pytest.mark.parametrize("card", ["qwen3_5-tiny", "qwen3-next-tiny"])
def test_packed_within_twice_the_replicated_layout_s_bf16_error(card):
    model, exact = bf16_model_and_exact_copy(card)
    batches = _batches()
    behaviour = []  # per micro-batch: old log-probs near the model's own, then reference ones
    for seed, batch in enumerate(batches):
        with torch.no_grad():
            current = [[x.float().cpu() for x in group] for group in forward_logprobs(model, batch)]
        behaviour += [perturbed(current, 0.3, seed), perturbed(current, 0.1, seed + 10)]
    want_logprobs, want_grads = _step(exact, batches, behaviour, "packed")
    packed_logprobs, packed_grads = _step(model, batches, behaviour, "packed")
    replicated_logprobs, replicated_grads = _step(model, batches, behaviour, "replicated")
    assert_within_twice_the_reference_error("log-probs", packed_logprobs, replicated_logprobs, want_logprobs, 1e-3)
    assert packed_grads.keys() == replicated_grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        assert_within_twice_the_reference_error(name, packed_grads[name], replicated_grads[name], want, 1e-3)
