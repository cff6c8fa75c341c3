"""megatron-dualkv: shared-prefix (DualKV) packing and attention for RL post-training on Megatron-Core:
one prompt and its responses, or prefix trees of trajectories."""
from .attention import dualkv_attn_func, dualkv_prefix_attn_func
from .layout import DualKVLayout, PackedLayout, PrefixedLayout, TreeLayout
from .packing import PackedBatch, ReplicatedBatch, RolloutGroup, pack_groups
from .planner import CostModel, MicroBatchPlan, PlannedMicroBatch, plan_micro_batches, trajectory_groups
from .trajectories import Trajectory, TrajectoryBatch, held_path_len, pack_trajectories

__all__ = [
    "CostModel",
    "DualKVLayout",
    "MicroBatchPlan",
    "PackedBatch",
    "PackedLayout",
    "PlannedMicroBatch",
    "PrefixedLayout",
    "ReplicatedBatch",
    "RolloutGroup",
    "Trajectory",
    "TrajectoryBatch",
    "TreeLayout",
    "dualkv_attn_func",
    "dualkv_prefix_attn_func",
    "held_path_len",
    "pack_groups",
    "pack_trajectories",
    "plan_micro_batches",
    "trajectory_groups",
]
__version__ = "0.2.0"
