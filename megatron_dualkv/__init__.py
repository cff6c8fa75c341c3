"""megatron-dualkv: shared-prompt (DualKV) packing and attention for RL post-training on Megatron-Core."""
from .attention import dualkv_attn_func
from .layout import DualKVLayout
from .packing import PackedBatch, ReplicatedBatch, RolloutGroup, pack_groups

__all__ = ["DualKVLayout", "PackedBatch", "ReplicatedBatch", "RolloutGroup", "dualkv_attn_func", "pack_groups"]
__version__ = "0.1.0"
