"""Hypothesis strategies for rollout groups: odd sizes on purpose (P or R of 1, N of 1, uneven
responses, many groups)."""
from hypothesis import strategies as st

from megatron_dualkv import RolloutGroup


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
