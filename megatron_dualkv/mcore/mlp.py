"""``DualKVMLP``: Megatron's dense ``MLP`` whose activation output can be recomputed instead of kept
(``recompute_activations``, ``mcore.recompute``): the local spec's dense MLP when that is on, and
the base of ``GemmaMLP``.

Megatron's ``MLP.forward`` computes the activation inline between ``linear_fc1`` and
``linear_fc2``; here it is ``activation``, the same computation (Megatron's fused SwiGLU where
``bias_activation_fusion`` is on, its unfused gated unit otherwise), run through
``checkpoint_without_output`` and released once ``linear_fc2`` has saved it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.transformer.mlp import MLP
from torch import Tensor

from .glu import plain_gated_linear_unit
from .recompute import RecomputableActivation, checkpoint_without_output
from .spec_entries import module_of, with_module


class DualKVMLP(RecomputableActivation, MLP):
    """``MLP`` whose activation is recomputed in layers where ``recompute_activation`` is set."""

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        if getattr(config, "recompute_activations", False):
            self.check_recomputable_activation()

    def check_recomputable_activation(self) -> None:
        """ValueError naming ``recompute_activations`` where ``activation`` is not Megatron's."""
        config = self.config
        if getattr(config, "use_te_activation_func", False):
            raise ValueError("recompute_activations: Transformer Engine's activation (use_te_activation_func) is not "
                             "recomputed")
        if config.bias_activation_fusion and not (config.gated_linear_unit and config.activation_func is F.silu):
            raise ValueError("recompute_activations: of Megatron's fused activations (bias_activation_fusion) only "
                             "SwiGLU is recomputed")
        if config.gated_linear_unit and not plain_gated_linear_unit(config):
            raise ValueError("recompute_activations: a gated linear unit without a clamp or a linear offset")

    def activation(self, intermediate: Tensor) -> Tensor:
        """fc1's output (bias added) -> fc2's input, as Megatron's ``MLP.forward`` computes it."""
        if self.config.bias_activation_fusion:
            return bias_swiglu_impl(intermediate, None, self.config.activation_func_fp8_input_store)
        if self.config.gated_linear_unit:
            gate, linear = torch.chunk(intermediate, 2, dim=-1)
            return self.activation_func(gate) * linear
        return self.activation_func(intermediate)

    def forward(self, hidden_states: Tensor, per_token_scale: Optional[Tensor] = None, **kwargs):
        if per_token_scale is not None:  # as an expert: Megatron's path
            return super().forward(hidden_states, per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        activated, release = checkpoint_without_output(self.activation, intermediate, enabled=self.recompute_activation)
        output = self.linear_fc2(activated)
        release(output[0])
        return output


def with_dualkv_mlp(mlp):
    """A layer's ``mlp`` spec entry with ``DualKVMLP`` for Megatron's dense ``MLP`` (0.16:
    ``ModuleSpec(MLP)``, 0.17+: ``partial(MLP.as_mlp_submodule)``); other entries unchanged."""
    module = module_of(mlp)
    if module is MLP:
        return with_module(mlp, DualKVMLP)
    if module is not None and module == getattr(MLP, "as_mlp_submodule", None):
        return with_module(mlp, DualKVMLP.as_mlp_submodule)
    return mlp
