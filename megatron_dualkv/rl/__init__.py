"""RL on the packed layouts (prompts and responses, or prefix trees of trajectories): per-token
log-probs (vocab-parallel; ``trajectory_logprobs`` per trajectory), GRPO/DAPO losses,
``forward_backward``, the entry point for Megatron-based RL loops (README: "Embedding in a
Megatron RL loop"), and PPO mini-batches and epochs over it (``ppo``)."""
from .logprobs import response_logprobs, vocab_parallel_logprobs
from .losses import DAPOLoss, GRPOLoss, PolicyLoss, PolicyLossOutput, clipped_policy_loss, group_normalized_advantages
from .ppo import MiniBatch, PPOUpdate, forward_only, plan_mini_batches, ppo_updates
from .prefix_reuse import PrefixReuseBatch, pack_prefix_reuse, pack_prefix_reuse_trajectories
from .responses import ResponseTokens
from .step import RLMicroBatch, RLStepOutput, forward_backward, forward_logprobs, rl_forward_step, trajectory_logprobs

__all__ = [
    "DAPOLoss",
    "GRPOLoss",
    "MiniBatch",
    "PPOUpdate",
    "PolicyLoss",
    "PolicyLossOutput",
    "PrefixReuseBatch",
    "RLMicroBatch",
    "RLStepOutput",
    "ResponseTokens",
    "clipped_policy_loss",
    "forward_backward",
    "forward_logprobs",
    "forward_only",
    "group_normalized_advantages",
    "pack_prefix_reuse",
    "pack_prefix_reuse_trajectories",
    "plan_mini_batches",
    "ppo_updates",
    "response_logprobs",
    "rl_forward_step",
    "trajectory_logprobs",
    "vocab_parallel_logprobs",
]
