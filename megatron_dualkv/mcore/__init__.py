"""Megatron-Core integration: DualKV core attention, layer specs, the GPT model, the config class
(``DualKVTransformerConfig``), activation recompute without Transformer Engine (``recompute``), the
parallel layout (``plan_parallel``; Ulysses context parallelism in ``context_parallel``) and the CPU compatibility
module (applied explicitly with ``enable_cpu_compat()``), and Megatron's optimizer without Transformer
Engine or Apex: its multi-tensor ops (``use_foreach_multi_tensor_ops()``) and fused Adam (``use_fused_adam()``)."""
from .attention import DualKVAttention
from .config import DualKVTransformerConfig
from .cpu_compat import disable_cpu_compat, enable_cpu_compat
from .gpt_model import DualKVGPTModel
from .multi_tensor import use_foreach_multi_tensor_ops, use_fused_adam
from .layer_specs import dualkv_local_block_spec, dualkv_te_block_spec, transformer_engine_available
from .packed_seq_params import DualKVPackedSeqParams
from .norms import SequenceParallelTorchNorm
from .parallel import ParallelPlan, ParallelSizes, current_parallel_sizes, initialize_parallel_state, plan_parallel
from .recompute import RECOMPUTE_MODES, DualKVTransformerLayer, recompute_config_kwargs

__all__ = [
    "DualKVAttention",
    "DualKVGPTModel",
    "DualKVPackedSeqParams",
    "DualKVTransformerConfig",
    "DualKVTransformerLayer",
    "RECOMPUTE_MODES",
    "ParallelPlan",
    "ParallelSizes",
    "SequenceParallelTorchNorm",
    "current_parallel_sizes",
    "disable_cpu_compat",
    "dualkv_local_block_spec",
    "dualkv_te_block_spec",
    "enable_cpu_compat",
    "initialize_parallel_state",
    "plan_parallel",
    "recompute_config_kwargs",
    "transformer_engine_available",
    "use_foreach_multi_tensor_ops",
    "use_fused_adam",
]
