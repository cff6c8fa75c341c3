"""The one check our fused gated activations share (``GemmaMLP``'s GeGLU, ``GroupedMMExperts``' SwiGLU)."""
from megatron.core.transformer.transformer_config import TransformerConfig


def plain_gated_linear_unit(config: TransformerConfig) -> bool:
    """A gated linear unit, ``act(gate) * linear``, without Megatron's variations on it (a clamp on the
    activation, an offset on the linear half, in newer releases): what the fused paths compute."""
    return bool(config.gated_linear_unit) and getattr(config, "activation_func_clamp_value", None) is None \
        and not getattr(config, "glu_linear_offset", 0.0)
