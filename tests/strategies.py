"""Hypothesis strategies for rollout groups and prefix trees of trajectories: odd sizes on purpose
(P or R of 1, N of 1, uneven responses, segments of one token, many groups)."""
from hypothesis import strategies as st

from megatron_dualkv import RolloutGroup, Trajectory


@st.composite
def rollout_groups(draw, max_groups=4, max_prompt=12, max_responses=4, max_response=10, vocab=50):
    """A list of RolloutGroup with random token ids."""
    ids = lambda n: draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))  # noqa: E731
    groups = []
    for _ in range(draw(st.integers(1, max_groups))):
        prompt = ids(draw(st.integers(1, max_prompt)))
        n = draw(st.integers(1, max_responses))
        responses = [ids(draw(st.integers(1, max_response))) for _ in range(n)]
        groups.append(RolloutGroup(prompt=prompt, responses=responses))
    return groups


def layout_lengths(draw, max_groups=4, max_prompt=12, max_responses=4, max_response=10):
    """(prompt_lens, response_lens) drawn with the same shape distribution as rollout_groups."""
    groups = draw(rollout_groups(max_groups, max_prompt, max_responses, max_response, vocab=2))
    return tuple(len(g.prompt) for g in groups), tuple(tuple(map(len, g.responses)) for g in groups)


@st.composite
def trajectory_sets(draw, max_groups=3, max_depth=5, max_branching=4, max_segment=6, max_segments=14, vocab=5,
                    grouped=None):
    """A list of Trajectory drawn from random prefix trees: per group one or two roots, every
    segment up to ``max_branching`` children to ``max_depth`` levels below its root (at most
    ``max_segments`` segments per group), segments of 1..max_segment tokens from a small
    vocabulary (so that siblings often start alike and the trie merges them), trajectories that end
    at leaves and some that end inside the tree (at an inner node or inside a segment), duplicates,
    and a shuffled order. ``grouped``: trajectories carry group ids (drawn when None); with rewards
    and loss masks on some draws."""
    grouped = draw(st.booleans()) if grouped is None else grouped
    with_rewards, with_masks = draw(st.booleans()), draw(st.booleans())
    ids = lambda n: draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))  # noqa: E731
    paths = []  # (group, tokens)

    def grow(group, budget, prefix, depth):
        budget[0] -= 1
        path = prefix + ids(draw(st.integers(1, max_segment)))
        kids = min(draw(st.integers(0, max_branching)) if depth < max_depth else 0, budget[0])
        if kids == 0 or draw(st.integers(0, 3)) == 0:  # a leaf, or a trajectory ending inside the tree
            paths.append((group, path[:draw(st.integers(len(prefix) + 1, len(path)))] if kids else path))
        for _ in range(kids):
            if budget[0] > 0:
                grow(group, budget, path, depth + 1)

    for g in range(draw(st.integers(1, max_groups)) if grouped else 1):
        budget = [max_segments]
        for _ in range(draw(st.integers(1, 2))):
            grow(g, budget, [], 0)
    paths += [paths[i] for i in draw(st.lists(st.integers(0, len(paths) - 1), max_size=2))]  # identical ones
    paths = draw(st.permutations(paths))
    return [
        Trajectory(tokens, loss_mask=draw(st.lists(st.booleans(), min_size=len(tokens), max_size=len(tokens)))
                   if with_masks else None,
                   reward=float(draw(st.integers(-2, 2))) if with_rewards else None, group=g if grouped else None)
        for g, tokens in paths
    ]


def tree_lengths(draw, max_segments=12, max_len=8):
    """(segment_lens, segment_parent) of a random forest in DFS order: each segment's parent is
    -1 or the previous segment or one of its ancestors."""
    lens, parents, path = [], [], []
    for s in range(draw(st.integers(1, max_segments))):
        parent = draw(st.sampled_from([-1, *path]))
        del path[path.index(parent) + 1 if parent >= 0 else 0:]
        path.append(s)
        lens.append(draw(st.integers(1, max_len)))
        parents.append(parent)
    return tuple(lens), tuple(parents)
