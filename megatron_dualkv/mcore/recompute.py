"""Activation recompute: the modes ``build_model(recompute=...)`` offers, and the selective recompute
of norm outputs and MLP activations that our layer specs run, with or without Transformer Engine.

Modes (``recompute_config_kwargs`` turns a mode and ``recompute_layers`` into ``TransformerConfig``
fields, the one definition the builder, launch scripts, benchmarks and the memory model share):

* ``"none"``: every activation is kept for the backward.
* ``"selective"``: in every layer, the outputs of the input and pre-MLP norms (what ``linear_qkv``
  and ``linear_fc1`` save), the normed and rotated q and k (what the attention kernel saves) and
  the MLP activation (what ``linear_fc2`` saves: SwiGLU, Gemma's GeGLU, the routed experts' SwiGLU)
  are freed once their consumer has saved them and recomputed in the backward. Under FP8 only the
  q and k: the norm outputs and the activation feed Transformer Engine's FP8 linears, which keep
  1-byte copies of them whatever the recompute, so recomputing them would free nothing. With
  ``recompute_layers=N``, Megatron also recomputes the first N layers of every pipeline stage
  (model chunk) whole, and the selective part is off inside those layers.
* ``"offload"``: "selective" in every layer, and with ``recompute_layers=N`` the first N layers of
  every stage (model chunk) keep what they save in page-locked host memory instead of on the GPU
  (``mcore.offload``: copied out and back beside the kernels). Instead of recomputing N layers
  whole, where the copies hide behind compute (the memory model offers at most a third of a stage).
* ``"full"``: Megatron's full recompute: every layer keeps only its input (``recompute_layers=N``:
  only the first N layers of every stage or chunk do, the others keep everything).

Megatron-Core's own selective recompute of norms and activations ("layernorm", "moe_act") goes
through ``tensor_parallel.CheckpointWithoutOutput``, which reads Transformer Engine's
``FP8GlobalStateManager`` even without fp8 (a ``NameError`` without TE, megatron-core 0.16 and
0.19). ``checkpoint_without_output`` is the same mechanism without TE: the function runs without
autograd, saving only its inputs; ``release(consumer_output)`` frees the output's storage once its
consumer (a linear) has saved it, and a gradient hook on the consumer's output recomputes it into
that storage just before the consumer's backward reads it. The recompute draws no random numbers
and restores no RNG state (unlike Megatron's, which forks the RNG states for dropout): it is only
for deterministic functions, the norms and activations of our specs.

The modules: norms that subclass ``RecomputableOutput`` (``FusedRMSNorm``, ``GemmaRMSNorm``),
q/k norms and RoPE of ``RecomputableQueryKey`` self-attentions (``DualKVSelfAttention``,
``GemmaSelfAttention``), activations of ``RecomputableActivation`` modules (``DualKVMLP`` and
``GemmaMLP``, ``GroupedMMExperts``), switched on per layer by ``DualKVTransformerLayer``.

In the Transformer Engine specs the same fields apply: the norms whose outputs are freed are ours
in front of TE's plain linears (a norm fused into TE's ``LayerNormLinear`` keeps its output inside
it), and TE's grouped experts recompute their activation through Megatron's own ``moe_act``
mechanism, which ``DualKVTransformerLayer`` turns on in them.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import Tensor

RECOMPUTE_MODES = ("none", "selective", "offload", "full")

# Megatron-Core's selective modules that checkpoint without output through Transformer Engine
TE_ONLY_RECOMPUTE_MODULES = ("layernorm", "moe_act")

# Our selective recompute (DualKVTransformerConfig): what recompute="selective" turns on
SELECTIVE_RECOMPUTE_FIELDS = ("recompute_norms", "recompute_qk_norm_rope", "recompute_activations")
# ... and under FP8 (the module docstring says why)
FP8_SELECTIVE_RECOMPUTE_FIELDS = ("recompute_qk_norm_rope",)

Release = Callable[[Tensor], None]


def refuse_offload_under_fp8(offload_layers: Optional[int], fp8: bool) -> None:
    """ValueError for offloaded layers under FP8: TE's linears save each micro-batch's FP8 copies of
    their weights (its weight cache is off) and inputs, which would go to the host and back."""
    if offload_layers and fp8:
        raise ValueError("recompute='offload' does not run under FP8: TE's linears would send each micro-batch's "
                         "FP8 copies of their weights and inputs to the host and back; offload in bf16, or recompute "
                         "(recompute='selective' with recompute_layers=N) instead")


def recompute_config_kwargs(mode: Optional[str], layers: Optional[int] = None, fp8: bool = False) -> Dict[str, Any]:
    """The ``DualKVTransformerConfig`` fields of recompute ``mode`` ("none", "selective", "full";
    None is "none") with ``layers`` = N layers of every pipeline stage (model chunk) recomputed
    whole (None: "full" recomputes every layer, "selective" none whole); fp8: the linears run in
    FP8 (``FP8_SELECTIVE_RECOMPUTE_FIELDS``).

    "offload" with N: "selective", and the first N layers of every stage offloaded (N required).

    The ladder the memory model climbs: none -> selective -> offload with N = 1 .. L/3 -> selective
    with N = 1 .. L -> full.
    ValueError naming ``recompute`` / ``recompute_layers`` for an unknown mode or a bad N (the
    upper bound, the layers of a stage, is the builder's check: it knows the split).
    """
    mode = "none" if mode is None else mode
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES} (or None), got {mode!r}")
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"recompute_layers must be a positive int (layers per pipeline stage), got {layers!r}")
        if mode == "none":
            raise ValueError(
                f"recompute_layers={layers} recomputes layers whole; it needs recompute='selective' or 'full'"
            )
    elif mode == "offload":
        raise ValueError("recompute='offload' needs recompute_layers=N: the layers of each stage to offload")
    if mode == "offload":
        return {**recompute_config_kwargs("selective", fp8=fp8), "offload_layers": layers}
    kwargs: Dict[str, Any] = {}
    if mode == "selective":
        # Megatron's own selective modules stay off: "layernorm" and "moe_act" need TE, and
        # "core_attn" would recompute a fused attention kernel for nothing.
        kwargs.update(recompute_granularity="selective", recompute_modules=[],
                      **dict.fromkeys(FP8_SELECTIVE_RECOMPUTE_FIELDS if fp8 else SELECTIVE_RECOMPUTE_FIELDS, True))
    if layers is not None:
        kwargs.update(recompute_granularity="full", recompute_method="block", recompute_num_layers=layers)
        kwargs.pop("recompute_modules", None)
    elif mode == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return kwargs


def fully_recomputed(config: TransformerConfig, layer_in_chunk: int) -> bool:
    """Whether Megatron recomputes the layer whole in training (``TransformerBlock``'s checkpointed
    forward). layer_in_chunk: 1-based within its pipeline stage (model chunk)."""
    if config.recompute_granularity != "full":
        return False
    return config.recompute_method == "uniform" or layer_in_chunk <= config.recompute_num_layers


_outputs_kept = 0  # depth of ``outputs_kept`` contexts


@contextmanager
def outputs_kept():
    """Inside: ``checkpoint_without_output`` is a plain call. For saved-tensor hooks that copy what
    the consumers save elsewhere (``rl.host_stash``): the consumer's copy is then not the output,
    so freeing the output would save nothing, and its recompute in the backward would fill a
    storage that no one reads."""
    global _outputs_kept
    _outputs_kept += 1
    try:
        yield
    finally:
        _outputs_kept -= 1


def checkpoint_without_output(function: Callable[..., Tensor], *inputs, enabled: bool = True) -> Tuple[Tensor, Release]:
    """``function(*inputs)`` whose output can be freed and recomputed: (output, release).

    function: deterministic (it is run again in the backward), returning one new tensor (not a
        view of an input); the parameters it uses get their gradients in the backward as usual.
    release(consumer_output): frees the output's storage (its consumer must have saved what it
        needs: a linear saves its input) and recomputes it into that storage when the gradient of
        ``consumer_output`` is computed, which must come before any backward that reads it. Without
        a call the output is kept, and recomputed only for this function's own backward.
    Not ``enabled``, without grad mode, inside ``outputs_kept``, or when no input requires grad, it
    is a plain call and release does nothing.
    """
    if (not enabled or _outputs_kept or not torch.is_grad_enabled()
            or not any(isinstance(x, Tensor) and x.requires_grad for x in inputs)):
        return function(*inputs), _keep
    slot: Dict[str, Any] = {}
    output = _WithoutSavedOutput.apply(function, slot, *inputs)
    return output, partial(_release, slot["ctx"], output)


def _keep(consumer_output: Tensor) -> None:
    pass


class _WithoutSavedOutput(torch.autograd.Function):
    """function(*inputs) with only the inputs saved; the backward backpropagates through a
    recomputation: the release hook's (``ctx.recomputed``), or its own when the output was never
    released. ``slot`` hands ``ctx`` to the caller; ``ctx`` holds no reference to the output, whose
    grad_fn it is, so no reference cycle keeps the saved inputs alive."""

    @staticmethod
    def forward(ctx, function, slot, *inputs):
        ctx.function, ctx.recomputed = function, None
        ctx.save_for_backward(*inputs)
        slot["ctx"] = ctx
        return function(*inputs)

    @staticmethod
    def backward(ctx, grad_output):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("recomputed activations need .backward(), not torch.autograd.grad()")
        inputs, output = ctx.recomputed or _recompute(ctx)
        ctx.recomputed = None
        torch.autograd.backward(output, grad_output)
        return (None, None, *(None if x is None or not x.requires_grad else x.grad for x in inputs))


def _recompute(ctx) -> Tuple[tuple, Tensor]:
    inputs = tuple(x if x is None else x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors)
    with torch.enable_grad():
        return inputs, ctx.function(*inputs)


def _release(ctx, output: Tensor, consumer_output: Tensor) -> None:
    if not consumer_output.requires_grad:
        return  # no backward comes through the consumer: keep the output
    storage = output.untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)  # the tensor keeps its metadata; what the consumer saved is this tensor
    # the hook lives as long as the graph (to the end of the whole backward): it holds the output
    # only until it has run, so that the restored storage goes with the consumer's saved input
    consumer_output.register_hook(partial(_restore, ctx, [output], nbytes))


def _restore(ctx, pending: list, nbytes: int, grad: Tensor) -> None:
    if not pending:
        return  # a second backward through a retained graph: restored by the first
    output = pending.pop()
    ctx.recomputed = _recompute(ctx)
    output.untyped_storage().resize_(nbytes)
    # through .data: the consumer saved ``output`` and would take a bumped version counter for an in-place change
    output.data.copy_(ctx.recomputed[1])


class RecomputableOutput(torch.nn.Module):
    """A module (a norm) whose output can be recomputed instead of kept: ``forward`` runs
    ``compute``; with ``recompute_output`` set (``DualKVTransformerLayer`` sets it on its input and
    pre-MLP norms) as ``checkpoint_without_output``, and ``discard_output(consumer_output)`` then
    releases that output."""

    recompute_output = False
    _pending_release: Release = staticmethod(_keep)  # this forward's release, until discard_output

    def compute(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        output, self._pending_release = checkpoint_without_output(self.compute, x, enabled=self.recompute_output)
        return output

    def discard_output(self, consumer_output: Tensor) -> None:
        """Release this forward's output (``checkpoint_without_output``); a no-op when not recomputed."""
        release, self._pending_release = self._pending_release, _keep
        release(consumer_output)


class RecomputableActivation:
    """Mixin of the MLP modules whose activation output can be recomputed instead of kept
    (``checkpoint_without_output`` over the activation, released after ``linear_fc2``). Each
    refuses, when built with ``recompute_activations``, a configuration it cannot recompute."""

    recompute_activation = False
    """Set per layer by ``DualKVTransformerLayer``."""


class RecomputableQueryKey:
    """Mixin of the self-attention modules whose normed and rotated q and k can be recomputed
    instead of kept (``DualKVSelfAttention``: released after the attention sublayer's forward)."""

    recompute_qk_norm_rope = False
    """Set per layer by ``DualKVTransformerLayer``."""


class DualKVTransformerLayer(TransformerLayer):
    """``TransformerLayer`` running the selective recompute of ``DualKVTransformerConfig``
    (``recompute_norms``, ``recompute_qk_norm_rope``, ``recompute_activations``), except in layers
    that Megatron recomputes whole: there the norms and activations would be recomputed twice.

    The input norm's output is released after the self-attention's forward, the pre-MLP norm's
    after the MLP's (the router and the token permutation of a MoE layer read it too): the
    gradients of those outputs come first in the backward.
    """

    def __init__(self, config: TransformerConfig, submodules, layer_number: int = 1, *args, **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.position = layer_number  # Megatron's block numbers a chunk's layers from 1
        if fully_recomputed(config, layer_number):
            return
        if getattr(config, "recompute_norms", False):
            self._recompute_norm_outputs()
        if getattr(config, "recompute_qk_norm_rope", False):
            self._recompute_query_key()
        if getattr(config, "recompute_activations", False):
            self._recompute_activation()

    def forward(self, *args, **kwargs):
        offloaded = getattr(self.config, "offload_layers", 0)
        if not (offloaded and self.training and torch.is_grad_enabled()):
            return super().forward(*args, **kwargs)
        # imported here: ``mcore.offload`` takes ``rl.host_stash``, and ``rl`` imports the models
        from .offload import layer_offload, prefetch_distance

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        with layer_offload().layer(self.position, self.position <= offloaded, device, prefetch_distance(offloaded),
                                   self.config.offload_min_bytes) as mark_output:
            output = super().forward(*args, **kwargs)
        mark_output(output[0] if isinstance(output, tuple) else output)
        return output

    def _recompute_norm_outputs(self) -> None:
        for name, consumer in (("input_layernorm", self.self_attention), ("pre_mlp_layernorm", self.mlp)):
            norm = getattr(self, name)
            if not isinstance(norm, RecomputableOutput):
                raise ValueError(
                    f"recompute_norms: layer {self.layer_number}'s {name} is a {type(norm).__name__}, which cannot "
                    "recompute its output (a norm fused into a linear keeps it: build the layer spec with "
                    "the config that has recompute_norms set)"
                )
            norm.recompute_output = True
            consumer.register_forward_hook(partial(_discard_norm_output, norm))

    def _recompute_query_key(self) -> None:
        if not isinstance(self.self_attention, RecomputableQueryKey):
            raise ValueError(
                f"recompute_qk_norm_rope: layer {self.layer_number}'s {type(self.self_attention).__name__} cannot "
                "recompute its q/k norms and RoPE (the local and Gemma specs' DualKVSelfAttention can)"
            )
        self.self_attention.recompute_qk_norm_rope = True

    def _recompute_activation(self) -> None:
        # MoE layers: the routed experts' activation; the router and shared experts are left alone
        module = self.mlp.experts if isinstance(self.mlp, MoELayer) else self.mlp
        if isinstance(self.mlp, MoELayer) and _is_te_grouped_experts(module):
            _turn_on_moe_act_recompute(module)
            return
        if not isinstance(module, RecomputableActivation):
            raise ValueError(
                f"recompute_activations: layer {self.layer_number}'s {type(module).__name__} cannot recompute its "
                "activation (the local spec's MLP, GemmaMLP and GroupedMMExperts can, and Transformer Engine's "
                "grouped experts)"
            )
        module.recompute_activation = True


def _is_te_grouped_experts(experts) -> bool:
    """Transformer Engine's grouped experts (``TEGroupedMLP``): Megatron's experts that carry its own
    ``moe_act`` recompute switch."""
    return not isinstance(experts, RecomputableActivation) and hasattr(experts, "activation_recompute")


def _turn_on_moe_act_recompute(experts) -> None:
    """Megatron's own ``moe_act`` recompute in ``experts``, as their constructor turns it on under
    ``recompute_modules=["moe_act"]``, which it takes only with selective granularity (not beside
    ``recompute_layers``)."""
    experts.activation_recompute = True
    if experts.config.fp8 or getattr(experts.config, "fp4", None):
        from megatron.core.extensions.transformer_engine import set_save_original_input

        set_save_original_input(experts.linear_fc2)  # fc2 keeps the recomputed input, not an FP8 copy


def _discard_norm_output(norm: RecomputableOutput, consumer, args, output) -> None:
    norm.discard_output(output[0])
