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
    """A list of Trajectory drawn from random prefix trees: per group a forest in DFS order of
    ``max_segments`` segments (fewer on some draws; one or two roots, up to ``max_branching``
    children per segment, ``max_depth`` levels below a root), segments of 1..max_segment tokens
    from a small vocabulary (so that siblings often start alike and the trie merges them), a
    trajectory per leaf and some that end inside the tree (inside a segment or at its end),
    duplicates, and a shuffled order. ``grouped``: trajectories carry group ids (drawn when None);
    with rewards and loss masks on some draws. The shapes come from a drawn ``Random``: uniform
    choices, where hypothesis' own draws would favour the smallest trees."""
    grouped = draw(st.booleans()) if grouped is None else grouped
    with_rewards, with_masks = draw(st.booleans()), draw(st.booleans())
    ids = lambda n: draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))  # noqa: E731
    shape = draw(st.randoms(use_true_random=False))
    paths = []  # (group, tokens)
    for g in range(draw(st.integers(1, max_groups)) if grouped else 1):
        # per segment its path's tokens and its child count; the path to the last segment
        tokens, children, path, roots = [], [], [], 0
        for s in range(shape.randint(1, max_segments) if shape.random() < 0.3 else max_segments):
            parents = [p for p in path[:max_depth] if children[p] < max_branching]
            parent = shape.choice(parents) if parents and (roots == 2 or shape.random() < 0.85) else -1
            roots += parent < 0
            del path[path.index(parent) + 1 if parent >= 0 else 0:]
            path.append(s)
            tokens.append((tokens[parent] if parent >= 0 else []) + ids(draw(st.integers(1, max_segment))))
            children.append(0)
            if parent >= 0:
                children[parent] += 1
        for s, path_tokens in enumerate(tokens):
            if not children[s]:
                paths.append((g, path_tokens))
            elif draw(st.integers(0, 3)) == 0:  # a trajectory ending inside the tree
                paths.append((g, path_tokens[:draw(st.integers(1, len(path_tokens)))]))
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
