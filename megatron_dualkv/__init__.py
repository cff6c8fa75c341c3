"""megatron-dualkv: shared-prompt (DualKV) packing and attention for RL post-training on Megatron-Core."""
from .attention import dualkv_attn_func
from .layout import DualKVLayout
from .packing import PackedBatch, ReplicatedBatch, RolloutGroup, pack_groups
from .planner import CostModel, MicroBatchPlan, PlannedMicroBatch, plan_micro_batches

__all__ = [
    "CostModel",
    "DualKVLayout",
    "MicroBatchPlan",
    "PackedBatch",
    "PlannedMicroBatch",
    "ReplicatedBatch",
    "RolloutGroup",
    "dualkv_attn_func",
    "pack_groups",
    "plan_micro_batches",
]
__version__ = "0.1.0"
