"""DualKV operators, one per module: ``reference`` (dense-mask oracle), the fused kernels, and
the references of linear-attention layers on the packed layout (``gated_delta_rule``,
``causal_conv1d``)."""
from .causal_conv1d import causal_conv1d_reference
from .gated_delta_rule import gated_delta_rule_reference
from .reference import dualkv_attention_reference

__all__ = ["causal_conv1d_reference", "dualkv_attention_reference", "gated_delta_rule_reference"]
