"""DualKV operators, one per module: ``reference`` (dense-mask oracle) and the fused kernels."""
from .reference import dualkv_attention_reference

__all__ = ["dualkv_attention_reference"]
