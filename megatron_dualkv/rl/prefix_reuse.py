"""Prefix reuse across micro-batches: a group too large for one micro-batch runs its prompt once.

``pack_prefix_reuse(group, parts)`` splits a group's responses into micro-batches that share one
``SharedPrompt``; ``pack_prefix_reuse_trajectories(trajectories, parts)`` does the same for the
trajectories of one prefix tree, whose held "prompt" is the path they all share up to their first
trained token (``held_path_len``) and whose parts are each the rest of the tree that their
trajectories reach (``PrefixedLayout`` with ``segment_parents``). In a step (``forward_backward``,
Megatron's schedule, micro-batches in order):

1. the first part's forward runs the prompt alone (positions 0..P-1) and holds, per layer, what
   its responses read of it: an attention layer's K/V exactly as DualKV attention consumes them
   (after the q/k norm and RoPE), a Gated DeltaNet layer's final recurrent state and the last
   K-1 inputs of its short conv (``DualKVGatedDeltaNet``); and the final hidden state of its last
   position, which predicts every response's first token (under context parallelism attention
   holds its rank's heads after the all-to-all, and the row is all-reduced from the rank whose
   slice has it);
2. every part runs its responses (``PrefixedLayout``: positions P..P+R_i-1): attention with
   ``dualkv_prefix_attn_func`` against the held K/V, a GDN layer from the held state and conv
   tail. In a training step the held tensors are detached leaves that require grad, so each
   part's backward accumulates the gradient flowing into the prompt in their ``.grad``;
3. when the last part's backward has finished, the prompt's backward runs once: from its last
   hidden state with the accumulated gradient, while each layer's held tensors (``HeldKV``,
   ``HeldState``: identities on the prompt's graph) add the accumulated gradient of their held
   copies to what the prompt's own layer sends back. The held copies are dropped when it starts,
   and each layer's accumulated gradient once its layer has used it.

With ``prefix_reuse_prompt_on_host`` in the model's config, what the prompt's forward saves for
its backward (every layer's input under full recompute) waits in page-locked host memory through
the parts (``host_stash``), so that a prompt too long to keep resident beside the held K/V still
runs once.

The gradient is the one-micro-batch step's: the prompt's forward is the same computation (DualKV
attention makes prompt states independent of the responses), and every path from the loss to the
prompt passes through the held tensors. Step 3 runs inside the last part's backward call (an
autograd engine callback), so Megatron's schedule sees one backward per micro-batch, DDP's
deferred gradient sync happens after it (its ``no_sync`` covers the earlier parts), and activation
recompute of the prompt's layers, which reruns ``_HeldKV`` in that backward, works unchanged.

Pipeline parallelism (the 1F1B schedule): each stage holds its own layers' K/V and runs steps 1
and 3 on its layers. The prompt's hidden states go on to the next stage inside the first part's
forward step, and their gradient comes back inside the last part's backward step: 1F1B runs a
micro-batch's backward on the next stage first, so both are there when a stage needs them. They
travel outside the schedule's own order, on a process group of their own (``prompt_pipeline``).
Only the last stage holds the last hidden state; the others start step 3 from the gradient received.

Losses: a part is a micro-batch of the plan like a sub-group (``planner``), or like a part of a
tree that carries its path: its advantages come from the whole group (``RLMicroBatch.advantages``),
its loss divides by the plan's ``loss_normalizer``.

Not supported yet (a ValueError names the combination): the interleaved pipeline schedule (its
model chunks would each run the prompt at their own turn), the replicated layout, DDP's overlapped
gradient reduce, and core attention other than ``DualKVAttention``.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model
from torch import Tensor

from ..layout import DualKVLayout, PrefixedLayout
from ..mcore.context_parallel import context_parallel_size, context_parallel_slice
from ..packing import PackedBatch, RolloutGroup, check_rollout_groups, pack_groups
from ..trajectories import (Trajectory, TrajectoryBatch, _loss_mask, _trajectory_tokens, held_path_len,
                           pack_trajectories)
from .host_stash import host_stash
from .prompt_pipeline import PromptPipeline, prompt_pipeline


class HeldPrompt:
    """One step's prompt state: per layer number its (k, v) rows of the prompt, the last position's
    final hidden state, and (training) the prompt's graph to backpropagate once."""

    def __init__(self, prompt_len: int, requires_grad: bool, on_host: bool = False):
        self.prompt_len = prompt_len
        self.requires_grad = requires_grad
        self.on_host = on_host  # the prompt's saved activations wait on the host (``host_stash``)
        # per layer number, what the parts read: an attention layer's (k, v) prompt rows, a GDN layer's
        # (conv tail, final state)
        self.kv: Dict[int, Tuple[Tensor, Tensor]] = {}
        self.holding = True  # until the prompt's backward: its recompute computes the held values again
        # from the prompt's backward on: per layer, what the parts accumulated in its held tensors' .grad
        self.grads: Dict[int, Tuple[Optional[Tensor], Optional[Tensor]]] = {}
        # the prompt's last hidden row, in its graph; on a pipeline stage before the last, its output
        self.root: Optional[Tensor] = None
        self.last_hidden: Optional[Tensor] = None
        # Under context parallelism one rank's slice holds that row, and the rank whose share of
        # the rows the loss projects has its gradient: it is summed over the CP ranks. The others'
        # roots are a row of their own slice with a zero gradient, so that their share of the
        # prompt's graph runs.
        self.owns_root = True
        self.cp_group = None
        self.pipeline: Optional[PromptPipeline] = None  # under pipeline parallelism
        self.input: Optional[Tensor] = None  # after the first stage: the previous stage's output, a leaf

    @property
    def on_last_stage(self) -> bool:
        return self.pipeline is None or self.pipeline.is_last

    def hold(self, layer: int, key: Tensor, value: Tensor, copy_key: bool) -> Tuple[Tensor, Tensor]:
        """What a layer's core attention calls on the prompt's k/v [t, heads, d]: they come back
        unchanged, held (``HeldKV``). ``copy_key``: the layer frees its key after its forward
        (recompute_qk_norm_rope)."""
        # Views only where the layer's own backward keeps its k/v on the GPU anyway: a training
        # forward with grad, its saved tensors not on the host. Elsewhere (a layer recomputed whole,
        # whose first forward runs without grad; a forward-only pass; the prompt on the host) a view
        # of value would keep all of linear_qkv's output alive. Decided here: inside HeldKV's
        # forward, grad mode is always off.
        copy_both = not (self.requires_grad and torch.is_grad_enabled() and not self.on_host)
        return HeldKV.apply(self, layer, (copy_key or copy_both, copy_both), key, value)

    def keep(self, layer: int, tensors: Tuple[Tensor, Tensor], rows: Tuple[slice, slice],
             copies: Tuple[bool, bool]) -> None:
        """Hold ``rows`` of ``layer``'s two tensors of the prompt (an attention layer's k and v, a GDN
        layer's conv input and final state), each a copy or a view as ``copies`` says (first forward
        only: a recompute of the layer in the prompt's backward computes the same values). A view is
        of the detached tensor, so it has a base (``_free_held_copies`` frees only copies)."""
        if not self.holding or layer in self.kv:
            return
        held = [x.detach()[r].clone() if copy else x.detach()[r] for x, r, copy in zip(tensors, rows, copies)]
        self.kv[layer] = tuple(x.requires_grad_(self.requires_grad) for x in held)

    def hold_state(self, layer: int, output: Tensor, conv_input: Tensor, final_state: Tensor, width: int) -> Tensor:
        """What a GDN layer calls on the prompt: its ``output`` back unchanged, holding copies of the
        prompt's last ``width - 1`` rows of ``conv_input`` [t, channels] (fewer in a shorter prompt)
        and of its ``final_state`` [heads, Dk, Dv] (both small: always copies)."""
        tail = slice(max(0, self.prompt_len - (width - 1)), self.prompt_len)
        return HeldState.apply(self, layer, tail, output, conv_input, final_state)

    def pop_gradients(self, layer: int) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """What the parts accumulated in ``layer``'s held tensors, handed out once."""
        return self.grads.pop(layer, (None, None))

    def add_held_gradients(self, layer: int, dk: Tensor, dv: Tensor) -> Tuple[Tensor, Tensor]:
        out = []
        for grad, held in zip((dk, dv), self.pop_gradients(layer)):
            if held is not None:
                grad = grad.clone()
                grad[: self.prompt_len] += held
            out.append(grad)
        return tuple(out)

    def backward(self) -> None:
        """The prompt's one backward, after every part's (``_AfterLastPart``)."""
        grad = self._root_gradient()
        # The held copies are read no more: their gradients alone go on, each layer's freed once that
        # layer's backward has added it, so the backward's peak is not the parts' (``MemoryModel``).
        self.grads = {layer: tuple(t.grad for t in tensors) for layer, tensors in self.kv.items()}
        self._free_held_copies()
        self.kv, self.holding = {}, False
        root, self.root = self.root, None
        torch.autograd.backward(root, grad)
        if self.input is not None:
            self.pipeline.send(self.input.grad, self.pipeline.stage - 1)
        self.release()

    def _root_gradient(self) -> Tensor:
        if not self.on_last_stage:
            # the next stage's prompt backward, inside its last part's backward, has sent it
            return self.pipeline.receive(torch.empty_like(self.root), self.pipeline.stage + 1)
        grad = self.last_hidden.grad if self.last_hidden.grad is not None else torch.zeros_like(self.last_hidden)
        if context_parallel_size(self.cp_group) > 1:
            torch.distributed.all_reduce(grad, group=self.cp_group)
            grad = grad if self.owns_root else torch.zeros_like(grad)
        return grad

    def _free_held_copies(self) -> None:
        """The last part's graph lives until its backward call, which runs the prompt's, has ended,
        and it references the held leaves (their AccumulateGrad nodes) and so their .grad: free the
        storage of our copies (views, which have a base, are of what the prompt's backward reads) and
        drop the gradients, which ``self.grads`` hands out one layer at a time."""
        for held in self.kv.values():
            for tensor in held:
                tensor.grad = None
                if tensor._base is None:
                    tensor.data = tensor.new_empty(0)

    def release(self) -> None:
        self.kv, self.grads, self.root, self.last_hidden, self.input = {}, {}, None, None, None


class HeldKV(torch.autograd.Function):
    """Identity on a layer's prompt k/v that holds them and, in the prompt's backward, adds the
    gradient the response micro-batches accumulated in the held copies."""

    @staticmethod
    def forward(ctx, held: HeldPrompt, layer: int, copies: Tuple[bool, bool], key: Tensor, value: Tensor):
        rows = slice(0, held.prompt_len)
        held.keep(layer, (key, value), (rows, rows), copies)
        ctx.held, ctx.layer = held, layer
        return key.view_as(key), value.view_as(value)

    @staticmethod
    def backward(ctx, dk, dv):
        return (None, None, None, *ctx.held.add_held_gradients(ctx.layer, dk, dv))


class HeldState(torch.autograd.Function):
    """Identity on a GDN layer's prompt output that holds the prompt's conv tail and final state and,
    in the prompt's backward, sends the gradients the parts accumulated in them to the conv input's
    tail rows and to the final state. One node after the delta rule for both, so that it runs in
    the backward (a node on the final state alone, which nothing in the prompt reads, would not)."""

    @staticmethod
    def forward(ctx, held: HeldPrompt, layer: int, tail: slice, output: Tensor, conv_input: Tensor,
                final_state: Tensor):
        held.keep(layer, (conv_input, final_state), (tail, slice(None)), (True, True))
        ctx.held, ctx.layer, ctx.tail, ctx.conv_shape = held, layer, tail, conv_input.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        tail_grad, state_grad = ctx.held.pop_gradients(ctx.layer)
        conv_grad = None
        if tail_grad is not None:  # a copy of the conv input's rows: its dtype
            conv_grad = tail_grad.new_zeros(ctx.conv_shape)
            conv_grad[ctx.tail] = tail_grad
        return None, None, None, grad, conv_grad, state_grad


class _AfterLastPart(torch.autograd.Function):
    """Identity on the last part's copy of the prompt's last hidden state that queues the prompt's
    backward to run when the backward call it is part of has finished (all gradients accumulated)."""

    @staticmethod
    def forward(ctx, held: HeldPrompt, hidden: Tensor):
        ctx.held = held
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        _queue_prompt_backward(ctx.held)
        return None, grad


def _queue_prompt_backward(held: HeldPrompt) -> None:
    # the engine's hook for work after the whole backward call (torch's DDP reduces there):
    # by then every part's gradient of the held tensors is in their .grad
    torch.autograd.Variable._execution_engine.queue_callback(held.backward)


@dataclass(eq=False)
class SharedPrompt:
    """A group's prompt (a tree's held path) shared by ``num_parts`` response micro-batches; ``held``
    lives from the first part's forward to the prompt's backward (or the last part's forward
    without one)."""

    tokens: Tensor
    num_parts: int
    pad_to_multiple_of: int = 1
    pad_token_id: int = 0
    held: Optional[HeldPrompt] = None

    @property
    def batch(self) -> PackedBatch:
        """The prompt alone as a packed micro-batch: a group without responses."""
        pad = -len(self.tokens) % self.pad_to_multiple_of
        tokens = torch.cat([self.tokens, self.tokens.new_full((pad,), self.pad_token_id)])
        return PackedBatch(tokens, DualKVLayout((len(self.tokens),), ((),), pad))


@dataclass(eq=False)
class PrefixReuseBatch:
    """One response micro-batch of a group whose prompt is held (``pack_prefix_reuse``), or one
    part of a tree whose shared path is held (``pack_prefix_reuse_trajectories``).

    tokens / layout: the responses, or the part's rest of a tree (and padding), ``PrefixedLayout``
    (positions after the prompt or held path).
    stub: the same responses after a one-token prompt (the prompt's last token), a ``PackedBatch``;
    for a tree the part's trajectories from the held path's last token on (untrained), a
    ``TrajectoryBatch`` whose packed order is that token, then ``tokens``': what the losses read
    (``ResponseTokens``, rewards), with the held last hidden state as that token's row.
    """

    prompt: SharedPrompt
    index: int
    tokens: Tensor
    layout: PrefixedLayout
    stub: Union[PackedBatch, TrajectoryBatch]

    @property
    def num_tokens(self) -> int:
        return self.layout.total_tokens

    @property
    def rewards(self):
        return self.stub.rewards


def pack_prefix_reuse(group: RolloutGroup, parts: Sequence[Sequence[int]], pad_to_multiple_of: int = 1,
                      pad_token_id: int = 0) -> List[PrefixReuseBatch]:
    """``group`` split into response micro-batches ``parts`` (lists of response indices, each
    response in one part) that share one prompt forward and backward per step (module docstring).
    Each part is padded to ``pad_to_multiple_of`` tokens, as is the prompt's own forward."""
    check_rollout_groups([group], "pack_prefix_reuse")
    _check_parts("pack_prefix_reuse", parts, len(group.responses), "the group's responses")
    prompt = SharedPrompt(torch.as_tensor(list(group.prompt), dtype=torch.long), len(parts))
    return [prefix_reuse_part(prompt, index, group.with_responses(part), pad_to_multiple_of, pad_token_id)
            for index, part in enumerate(parts)]


def pack_prefix_reuse_trajectories(trajectories: Sequence[Trajectory], parts: Sequence[Sequence[int]],
                                   pad_to_multiple_of: int = 1, pad_token_id: int = 0) -> List[PrefixReuseBatch]:
    """The trajectories of one prefix tree (one group, a common first token) split into
    micro-batches ``parts`` (lists of trajectory indices, each trajectory in one part) that share
    one forward and backward of their held path (``held_path_len``) per step; each part is the
    rest of the tree under it that its trajectories reach (module docstring)."""
    trajectories = list(trajectories)
    _check_parts("pack_prefix_reuse_trajectories", parts, len(trajectories), "the trajectories")
    seqs = [_trajectory_tokens(t, i) for i, t in enumerate(trajectories)]
    groups = {t.group for t in trajectories}
    if len(groups) > 1 or len({int(seq[0]) for seq in seqs}) > 1:
        raise ValueError("pack_prefix_reuse_trajectories: the trajectories must be one prefix tree (one group, "
                         f"one first token); got groups {sorted(map(repr, groups))} and first tokens "
                         f"{sorted({int(seq[0]) for seq in seqs})}")
    held = held_path_len(trajectories)
    if held < 1:
        raise ValueError("pack_prefix_reuse_trajectories: the trajectories share no path to hold: a trajectory of "
                         "one token leaves no token after it (plan such a tree with carried paths)")
    prompt = SharedPrompt(torch.from_numpy(seqs[0][:held]), len(parts))
    return [prefix_reuse_part(prompt, index, [trajectories[i] for i in part], pad_to_multiple_of, pad_token_id)
            for index, part in enumerate(parts)]


def _check_parts(caller: str, parts: Sequence[Sequence[int]], count: int, what: str) -> None:
    every = sorted(i for part in parts for i in part)
    if not parts or any(not part for part in parts) or every != list(range(count)):
        raise ValueError(f"{caller}: parts {[list(p) for p in parts]} must split {what} ({count}), "
                         "each into exactly one non-empty part")


def prefix_reuse_part(prompt: SharedPrompt, index: int, responses: Union[RolloutGroup, Sequence[Trajectory]],
                      pad_to_multiple_of: int = 1, pad_token_id: int = 0) -> PrefixReuseBatch:
    """Part ``index`` of ``prompt``'s micro-batches, packed with padding to ``pad_to_multiple_of``
    (the prompt's forward too): ``responses``, a ``RolloutGroup`` (its prompt with this part's
    responses), or this part's trajectories of a tree whose held path is ``prompt``."""
    prompt.pad_to_multiple_of, prompt.pad_token_id = pad_to_multiple_of, pad_token_id
    if not isinstance(responses, RolloutGroup):
        return _tree_part(prompt, index, list(responses), pad_to_multiple_of, pad_token_id)
    group = responses
    responses = [list(r) for r in group.responses]
    stub = pack_groups([RolloutGroup(list(group.prompt)[-1:], responses, group.rewards)])
    lens = tuple(map(len, responses))
    pad = -sum(lens) % pad_to_multiple_of
    tokens = torch.tensor([t for r in responses for t in r] + [pad_token_id] * pad, dtype=torch.long)
    return PrefixReuseBatch(prompt, index, tokens, PrefixedLayout((len(group.prompt),), (lens,), pad), stub)


def _tree_part(prompt: SharedPrompt, index: int, trajectories: List[Trajectory], pad_to_multiple_of: int,
               pad_token_id: int) -> PrefixReuseBatch:
    held = len(prompt.tokens)
    seqs = [_trajectory_tokens(t, i) for i, t in enumerate(trajectories)]
    masks = [_loss_mask(t, i, len(seq)) for i, (t, seq) in enumerate(zip(trajectories, seqs))]
    for i, (seq, mask) in enumerate(zip(seqs, masks)):
        # a token trained inside the path would silently leave the loss: its forward computes no log-probs
        if len(seq) <= held or not torch.equal(torch.from_numpy(seq[:held]), prompt.tokens) or mask[1:held].any():
            raise ValueError(f"prefix reuse: trajectory {i} of part {index} does not start with the held path of "
                             f"{held} tokens, train none of them and go on after it (held_path_len gives such a path)")
    rest = pack_trajectories([replace(t, tokens=seq[held:], loss_mask=None) for t, seq in zip(trajectories, seqs)],
                             pad_to_multiple_of, pad_token_id)
    stub = pack_trajectories([replace(t, tokens=seq[held - 1 :], loss_mask=torch.cat([mask.new_zeros(1), mask[held:]]))
                              for t, seq, mask in zip(trajectories, seqs, masks)])
    # Both tries are built alike and the stub's sequences all start with the path's last token, so
    # its packed order is that token, then the rest's: the stub's rows are the part's after the
    # held last hidden state's (prefix_reuse_output).
    assert all(torch.equal(s, torch.cat([s.new_zeros(1), r + 1]))
               for s, r in zip(stub.trajectory_index, rest.trajectory_index))
    layout = PrefixedLayout((held,), (rest.layout.segment_lens,), rest.layout.pad_len,
                            segment_parents=(rest.layout.segment_parent,))
    return PrefixReuseBatch(prompt, index, rest.tokens, layout, stub)


def prefix_reuse_output(model, micro_batch, layout: str):
    """(the final hidden states of the stub's rows, the micro-batch with the stub as its batch):
    this part's model output after the prompt's held last hidden state, running the prompt's
    forward first where this is its first part. The rows are every token's, with a backward that
    sums the TP ranks' gradients (``logprobs.all_rows``): the loss takes them with
    ``logprobs_from_output(..., all_tokens=True)``, and the prompt's backward starts from its
    last row with the held copy's gradient, which holds this rank's vocabulary shard's share. On a
    pipeline stage before the last: the part's output for the next stage, and the micro-batch."""
    from .logprobs import all_rows, packed_output

    part: PrefixReuseBatch = micro_batch.batch
    prompt = part.prompt
    if part.index == 0:
        check_prefix_reuse_supported(model, layout)
        prompt.held = _prompt_forward(model, prompt)
    held = prompt.held
    if held is None:
        raise ValueError(f"prefix reuse: part {part.index} runs before its prompt's first part (index 0); "
                         "give a group's parts in order, in one forward_backward call")
    output = packed_output(model, part, held)
    last = part.index == prompt.num_parts - 1
    if last and not held.requires_grad:
        prompt.held = None
    if not held.on_last_stage:
        if last and held.requires_grad:
            # a hook, not _AfterLastPart's identity: a stage's output must not be a view (Megatron's
            # deallocate_pipeline_outputs frees its storage once sent)
            output.register_hook(lambda _: _queue_prompt_backward(held))
        return output, micro_batch
    hidden = all_rows(model, output)
    first_row = _AfterLastPart.apply(held, held.last_hidden) if last and held.requires_grad else held.last_hidden
    hidden = torch.cat([first_row, hidden[: part.num_tokens - part.layout.pad_len]])
    return hidden, replace(micro_batch, batch=part.stub)


def _prompt_forward(model, prompt: SharedPrompt) -> HeldPrompt:
    from .logprobs import tensor_parallel_rows

    config = get_attr_wrapped_model(model, "config")
    on_host = torch.is_grad_enabled() and getattr(config, "prefix_reuse_prompt_on_host", False)
    held = HeldPrompt(len(prompt.tokens), torch.is_grad_enabled(), on_host)
    held.pipeline = prompt_pipeline()
    with host_stash().hooks() if on_host else nullcontext():
        output = _stage_prompt_output(model, prompt, held)
        if held.on_last_stage:
            output = tensor_parallel_rows(model, output)
    layers = len(get_attr_wrapped_model(model, "decoder").layers)  # this pipeline stage's
    if len(held.kv) != layers:
        raise ValueError(f"prefix reuse: {len(held.kv)} of {layers} layers held their prompt's K/V or state; it "
                         "needs DualKVAttention as every attention layer's core attention (as the library's layer "
                         "specs build them) and DualKVGatedDeltaNet as every Gated DeltaNet mixer")
    if held.on_last_stage:
        _hold_last_row(held, output, prompt.batch.num_tokens, get_attr_wrapped_model(model, "context_parallel_group"))
    else:
        held.root = output
        held.pipeline.send(output, held.pipeline.stage + 1)
    return held


def _stage_prompt_output(model, prompt: SharedPrompt, held: HeldPrompt) -> Tensor:
    """The prompt's output of this pipeline stage: from its tokens on the first stage, else from the
    previous stage's output (``held.input``) in place of the input the schedule set for the part."""
    from .logprobs import packed_output

    if held.pipeline is None or held.pipeline.is_first:
        return packed_output(model, prompt.batch, held)
    held.input = held.pipeline.receive(_stage_input_buffer(model, prompt), held.pipeline.stage - 1)
    held.input.requires_grad_(held.requires_grad)
    decoder = get_attr_wrapped_model(model, "decoder")
    parts_input = decoder.input_tensor
    decoder.set_input_tensor(held.input)
    try:
        return packed_output(model, prompt.batch, held)
    finally:
        decoder.set_input_tensor(parts_input)


def _stage_input_buffer(model, prompt: SharedPrompt) -> Tensor:
    """Room for this rank's rows of the previous stage's prompt output, as Megatron's schedule sizes
    a stage's input: its CP slice of the padded prompt, its shard of that under sequence parallelism."""
    from .logprobs import _model_device

    config = get_attr_wrapped_model(model, "config")
    local = context_parallel_slice(prompt.batch.num_tokens, get_attr_wrapped_model(model, "context_parallel_group"))
    rows = (local.stop - local.start) // (config.tensor_model_parallel_size if config.sequence_parallel else 1)
    return torch.empty(rows, 1, config.hidden_size, dtype=config.pipeline_dtype, device=_model_device(model))


def _hold_last_row(held: HeldPrompt, hidden: Tensor, num_tokens: int, cp_group) -> None:
    """``held``'s root and last hidden state from this rank's rows ``hidden`` of the prompt's
    ``num_tokens`` packed tokens (its CP slice)."""
    local = context_parallel_slice(num_tokens, cp_group)
    held.cp_group = cp_group
    last = held.prompt_len - 1
    held.owns_root = local.start <= last < local.stop
    row = last - local.start if held.owns_root else 0
    held.root = hidden[row : row + 1]
    last_hidden = held.root.detach()
    if context_parallel_size(cp_group) > 1:
        last_hidden = last_hidden.clone() if held.owns_root else torch.zeros_like(last_hidden)
        torch.distributed.all_reduce(last_hidden, group=cp_group)
    held.last_hidden = last_hidden.requires_grad_(held.requires_grad)


def check_prefix_reuse_supported(model, layout: str) -> None:
    """ValueError naming what prefix reuse does not run with yet."""
    unsupported = [
        (layout != "packed", f"the {layout} layout"),
        (bool(parallel_state.get_virtual_pipeline_model_parallel_world_size()),
         "the interleaved pipeline schedule (virtual pipeline parallelism)"),
        (getattr(getattr(model, "ddp_config", None), "overlap_grad_reduce", False),
         "DDP's overlap_grad_reduce (its buckets would reduce before the prompt's backward)"),
        (bool(getattr(getattr(model, "config", None), "offload_layers", 0)),
         "offloaded layers (recompute='offload': the held prompt K/V are views of what the prompt's layers save)"),
    ]
    for bad, what in unsupported:
        if bad:
            raise ValueError(f"prefix reuse (pack_prefix_reuse) does not support {what} yet")
