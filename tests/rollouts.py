"""Rollout batches with awkward shapes for the Megatron-Core and RL tests: uneven groups, a
one-token prompt, one-token responses, a group with a single response, and padding."""
import torch

from megatron_dualkv import RolloutGroup, pack_groups

# (prompt length, response lengths) per group
UNEVEN_SHAPES = [(5, [3, 1, 4]), (1, [2, 5]), (7, [6, 1]), (3, [1])]


def make_groups(shapes=UNEVEN_SHAPES, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    return [
        RolloutGroup(ids(p), [ids(r) for r in rs], torch.rand(len(rs), generator=g).round(decimals=1).tolist())
        for p, rs in shapes
    ]


def make_batch(shapes=UNEVEN_SHAPES, vocab=256, seed=0, pad_to_multiple_of=8):
    return pack_groups(make_groups(shapes, vocab, seed), pad_to_multiple_of=pad_to_multiple_of)


def perturbed(nested, scale, seed=0):
    """The same nested per-group, per-response tensors, detached, plus seeded noise."""
    g = torch.Generator().manual_seed(seed)
    return [[x.detach() + scale * torch.randn(x.shape, generator=g) for x in group] for group in nested]


def max_abs_diff(a, b):
    return max((x - y).abs().max().item() for ga, gb in zip(a, b) for x, y in zip(ga, gb))
