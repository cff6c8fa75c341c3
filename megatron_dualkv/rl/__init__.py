"""RL on the packed layout: per-token log-probs (vocab-parallel), GRPO/DAPO losses, and
``forward_backward``, the entry point for Megatron-based RL loops (README: "Embedding in a
Megatron RL loop")."""
from .logprobs import response_logprobs, vocab_parallel_logprobs
from .losses import DAPOLoss, GRPOLoss, PolicyLoss, PolicyLossOutput, clipped_policy_loss, group_normalized_advantages
from .responses import ResponseTokens
from .step import RLMicroBatch, RLStepOutput, forward_backward, forward_logprobs, rl_forward_step

__all__ = [
    "DAPOLoss",
    "GRPOLoss",
    "PolicyLoss",
    "PolicyLossOutput",
    "RLMicroBatch",
    "RLStepOutput",
    "ResponseTokens",
    "clipped_policy_loss",
    "forward_backward",
    "forward_logprobs",
    "group_normalized_advantages",
    "response_logprobs",
    "rl_forward_step",
    "vocab_parallel_logprobs",
]
