"""GRPO/DAPO policy update on Megatron-Core with the DualKV packed layout.

    python examples/grpo_policy_update.py                      # bundled defaults: qwen3-tiny on CPU, a few steps
    torchrun --nproc-per-node 2 examples/grpo_policy_update.py --tp 2
    python examples/grpo_policy_update.py --steps 4 --save ckpt
    python examples/grpo_policy_update.py --steps 8 --load ckpt --save ckpt   # resumes at step 5
    python examples/grpo_policy_update.py --mini-batches 2 --ppo-epochs 2 --clip-ratio-c 3 --lr-decay-style cosine \
        --tensorboard-dir tb --log-jsonl run.jsonl && python tools/plot_run.py run.jsonl

Every step takes the next --global-batch-size rollout groups of --rollouts (cycling through the
file; in a file of trajectories, one a line, a group is the trajectories of one "group" id: multi-turn
episodes packed as prefix trees, ``pack_trajectories``) and splits them into --mini-batches M
mini-batches of as many groups
(``megatron_dualkv.rl.plan_mini_batches``: packed micro-batches of at most --max-tokens tokens
for the data-parallel ranks, ``plan_micro_batches``). Before the first update it computes the
behaviour log-probs with one forward-only run of Megatron's schedule (or takes the rollouts'
``"logprobs"``: without --tis-cap they are the behaviour log-probs and that pass is skipped; with
one update per step, the defaults, the update's own forward gives them and that pass is skipped), the
reference log-probs of --ref-load the same way, and the advantages on whole groups; then --ppo-epochs
E times the M updates (``ppo_updates``): Megatron's forward/backward schedule with the GRPO or DAPO
loss, normalised over the mini-batch's groups, and Megatron's optimizer step. The learning rate
follows Megatron's ``OptimizerParamScheduler``, stepped once per step (as verl's Megatron actor),
saved and resumed with the checkpoint. ``--layout replicated`` runs the same micro-batches on the
standard layout (every response after its own prompt copy): the same losses, for side-by-side checks.

Logged on rank 0, one line per step (and one per update when a step has several): the loss; the
mean reward of the step's rollouts; ``margin``, the mean token log-prob of responses with positive
advantage minus that of the others (under the behaviour policy; it grows as the policy learns the
rewards); the clip fraction; rollout tokens per second (every response with its prompt, as the
replicated layout counts them, so both layouts compare); rho (the token reduction of the packed
plan); micro-batches per rank (all mini-batches) x DP ranks; peak memory (GPU: allocated, CPU:
process RSS); model TFLOP/s per device (the forward FLOPs of the layout run, ``megatron_dualkv.CostModel``,
once per forward-only pass plus 3x per epoch of updates) and MFU against --peak-tflops, or against
the bf16 matmul rate measured at start on a GPU; n/a on a CPU without --peak-tflops; then the
learning rate, the mean ratio, and where they apply the dual-clip fraction, the k3 KL to the
reference, the entropy of the behaviour policy and the rollout-training mismatch (mean
|behaviour - rollout| log-prob over response tokens). Token metrics are means over the step's
response tokens. --tensorboard-dir and --log-jsonl keep the same numbers (``megatron_dualkv.run_log``).

With one update per rollout batch the behaviour policy is the current one: the ratio is 1 and the
GRPO loss (sequence-mean of -A) is ~0 while its gradient is not; with several, later updates have
ratios != 1 and the clip acts. Checkpoints are taken at step boundaries only (after the step's last
update): a resumed run repeats no update and skips none.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import importlib.util
import math
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from megatron_dualkv.notices import hide_expected_notices

hide_expected_notices()  # before Megatron-Core is imported, which warns at import (--verbose keeps them)

import torch  # noqa: E402  (megatron_dualkv imports it anyway)
from megatron_dualkv._resources import available_cards  # noqa: E402
from megatron_dualkv.cli import (  # noqa: E402
    ArgumentParser, add_layer_spec_flags, exit_with_error, layer_spec, memory_margin_problem, spec_kwargs, spec_label,
)
from megatron_dualkv.rollout_io import RolloutFileError, Rollouts, find_tokenizer, read_rollouts  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
SAMPLE_TOKENIZER = DATA / "tokenizer.model"  # of the bundled sample rollouts, for the tiny cards' 256-token vocabulary
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
AUTO = "auto"  # --recompute and --max-tokens: chosen by the memory model
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's name for the last saved step
LR_DECAY_STYLES = ("constant", "linear", "cosine")
# OptimizerParamScheduler.state_dict() fields -> the flags that set them (the other fields follow from these)
SCHEDULE_FLAGS = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-steps",
                  "lr_decay_steps": "--lr-decay-steps", "lr_decay_style": "--lr-decay-style", "start_wd": "--weight-decay"}


class InputError(ValueError):
    """A problem with the command line or the input files: reported without a traceback."""


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("model and parallelism")
    group.add_argument("--model", default="qwen3-tiny",
                       help="a model card (name in models/, card file or HF config.json: random weights) or a converted "
                            "Megatron checkpoint folder (tools/convert_checkpoint.py: its weights)")
    group.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="parameter dtype (default: the card's)")
    group.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    group.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    group.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    group.add_argument("--cp", type=int, default=1, help="context-parallel size (Ulysses)")
    add_layer_spec_flags(group)
    group.add_argument("--layout", choices=["packed", "replicated"], default="packed")
    group.add_argument("--recompute", choices=["none", "selective", "offload", "full", "auto"], default="none",
                       help="activation recompute (build_model's recompute); offload: selective, and --recompute-layers "
                            "N layers' saved tensors in pinned host memory; auto: the least that fits the GPU "
                            "(megatron_dualkv.memory)")
    group.add_argument("--recompute-layers", type=int, default=None,
                       help="also recompute the first N layers of every pipeline stage whole (with offload: offload "
                            "them)")
    group.add_argument("--no-offload", dest="offload", action="store_false",
                       help="keep --recompute auto from offloading layers (their saved tensors in pinned host memory, "
                            "up to a third of each stage), which it otherwise tries before it recomputes layers whole")
    group.add_argument("--memory-margin", type=float, default=None,
                       help="share of the GPU's memory that --recompute auto and --max-tokens auto leave free "
                            "(default: the memory model's DEFAULT_MARGIN)")
    group = parser.add_argument_group("data")
    group.add_argument("--rollouts", type=Path, default=DATA / "rollouts.jsonl",
                       help="JSONL, one group a line: {prompt, responses, rewards[, logprobs]}; token ids, or text "
                            "(a prompt also as chat messages) with --tokenizer; or one trajectory a line: "
                            "{tokens[, loss_mask], reward, group} or {messages, reward, group} (multi-turn, tool "
                            "outputs masked), e.g. examples/data/agent_episodes.jsonl")
    group.add_argument("--tokenizer", type=_tokenizer_path, default=None,
                       help="for text rollouts: a SentencePiece .model, a Hugging Face tokenizer.json or model folder "
                            "(default: --model's own, from its folder; the bundled sample rollouts on a tiny card: "
                            "the bundled sample tokenizer)")
    group.add_argument("--global-batch-size", type=int, default=8, help="rollout groups per step, all DP ranks together")
    group.add_argument("--max-tokens", type=_tokens_or_auto, default=1024,
                       help="micro-batch token budget (packed tokens, on both layouts); auto: the most that fit the GPU "
                            "(packed: the whole largest group when --recompute is auto too, with the least recompute "
                            "that holds it)")
    group.add_argument("--prefix-reuse", choices=["auto", "on", "off"], default="auto",
                       help="a group over --max-tokens runs its prompt (a tree of trajectories the path they "
                            "share) once for all its micro-batches (on), or in sub-groups (parts) that each carry "
                            "it (off); auto: on where the run supports it")
    group = parser.add_argument_group("policy loss and updates")
    group.add_argument("--loss", choices=("dapo", "grpo"), default="grpo")
    group.add_argument("--mini-batches", type=int, default=1,
                       help="optimizer steps per rollout batch, each on 1/M of its groups (verl: ppo_mini_batch_size)")
    group.add_argument("--ppo-epochs", type=int, default=1, help="passes of the M updates over the rollout batch")
    group.add_argument("--clip-ratio-c", type=float, default=None,
                       help="dual-clip PPO: cap the token loss of a negative advantage A at -A * C (C > 1; default off)")
    group.add_argument("--tis-cap", type=float, default=None,
                       help="truncated importance sampling: weight each token by min(pi_old / pi_rollout, C) with the "
                            "rollouts' 'logprobs' (C > 0; default off: those log-probs are the behaviour log-probs)")
    group.add_argument("--ref-load", type=Path, default=None,
                       help="reference policy: a converted Megatron checkpoint folder of --model's architecture (frozen)")
    group.add_argument("--kl-coef", type=float, default=0.0, help="weight of the k3 KL to the reference policy")
    group = parser.add_argument_group("optimizer and learning rate")
    group.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    group.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of the decay")
    group.add_argument("--lr-warmup-steps", type=int, default=0, help="steps of linear warmup from 0")
    group.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="constant")
    group.add_argument("--lr-decay-steps", type=int, default=None,
                       help="steps of warmup plus decay (default: --steps; a resumed run: the checkpoint's)")
    group.add_argument("--weight-decay", type=float, default=0.0)
    group.add_argument("--clip-grad", type=float, default=None, help="gradient-norm clip (default 1.0 on GPU; CPU: 0, off)")
    group.add_argument("--use-distributed-optimizer", action="store_true", help="shard optimizer state over DP ranks (GPU)")
    group.add_argument("--steps", type=int, default=8, help="last step to run (a resumed run continues up to it)")
    group.add_argument("--seed", type=int, default=1234)
    group = parser.add_argument_group("checkpoints and logging")
    group.add_argument("--save", type=Path, default=None, help="directory for Megatron distributed checkpoints")
    group.add_argument("--save-interval", type=int, default=0, help="also save every N steps (0: at the end only)")
    group.add_argument("--load", type=Path, default=None, help="resume from the latest checkpoint in this directory")
    group.add_argument("--tensorboard-dir", type=Path, default=None,
                       help="TensorBoard event folder (Megatron's scalar names)")
    group.add_argument("--log-jsonl", type=Path, default=None,
                       help="one JSON line per step and per update; a new run writes the file anew, a resumed run "
                            "(--load) appends to it")
    group.add_argument("--peak-tflops", type=float, default=None, help="per-device peak for MFU (default: measured on GPU)")
    group.add_argument("--verbose", action="store_true",
                       help="also show Megatron-Core's notices that Transformer Engine and Apex are not installed and "
                            "its deprecations (megatron_dualkv.notices)")
    # where --recompute/--max-tokens auto find prefix reuse's prompt fits only with its activations on the host
    parser.set_defaults(prompt_on_host=False)
    args = parser.parse_args(argv)
    for problem in _flag_problems(args):
        parser.error(problem)
    return args


def _flag_problems(args: argparse.Namespace) -> Iterable[str]:
    """What is wrong with the flags on their own (before the model and files are read)."""
    for name in ("tp", "pp", "ep", "cp", "global_batch_size", "max_tokens", "steps", "mini_batches", "ppo_epochs"):
        if getattr(args, name) != AUTO and getattr(args, name) < 1:
            yield f"--{name.replace('_', '-')} must be >= 1"
    if args.fp8 != "off" and args.transformer_engine == "off":
        yield f"--fp8 {args.fp8} runs Transformer Engine's linears in FP8: pass --transformer-engine on (or auto)"
    if args.fp8 != "off" and args.dtype == "float32":
        yield f"--fp8 {args.fp8} trains bf16 parameters with FP8 matmuls: pass --dtype bfloat16"
    if args.fp8 != "off" and args.recompute == "offload":
        yield (f"--recompute offload does not run with --fp8 {args.fp8} (each micro-batch's FP8 copies of the weights "
               "would go to the host and back): offload in bf16, or --recompute selective --recompute-layers N")
    if args.recompute == AUTO and args.recompute_layers is not None:
        yield "--recompute-layers is --recompute auto's to choose: pass one or the other"
    if not args.offload and args.recompute != AUTO:
        offloads = "its --recompute-layers" if args.recompute == "offload" else "none"
        yield f"--no-offload is for --recompute auto, which may otherwise offload layers (--recompute {args.recompute} " \
              f"offloads {offloads})"
    if margin_problem := memory_margin_problem(args.memory_margin):
        yield margin_problem
    if args.global_batch_size % args.mini_batches:
        yield (f"--global-batch-size {args.global_batch_size} does not split into --mini-batches {args.mini_batches} "
               "of equal size")
    if args.clip_ratio_c is not None and not args.clip_ratio_c > 1:
        yield (f"--clip-ratio-c must be > 1 (the dual clip caps the loss of a negative advantage at -A * C), "
               f"got {args.clip_ratio_c}")
    if args.tis_cap is not None and not args.tis_cap > 0:
        yield f"--tis-cap must be > 0 (the cap C of the importance weight min(pi_old / pi_rollout, C)), got {args.tis_cap}"
    if args.kl_coef < 0:
        yield f"--kl-coef must be >= 0, got {args.kl_coef}"
    if args.kl_coef and args.ref_load is None:
        yield "--kl-coef needs a reference policy (--ref-load)"
    if args.ref_load is not None and not args.ref_load.is_dir():
        yield f"--ref-load: not a checkpoint folder: {args.ref_load}"
    if not 0 <= args.min_lr <= args.lr:
        yield f"--min-lr must be between 0 and --lr {args.lr}, got {args.min_lr}"
    if args.lr_warmup_steps < 0 or (args.lr_decay_steps is not None and args.lr_decay_steps <= args.lr_warmup_steps):
        yield f"--lr-decay-steps ({args.lr_decay_steps}) must be larger than --lr-warmup-steps ({args.lr_warmup_steps}) >= 0"
    if not args.rollouts.is_file():
        yield f"--rollouts: file not found: {args.rollouts}"
    if not (Path(args.model).exists() or args.model in available_cards()):
        yield f"--model {args.model}: not a card name ({', '.join(available_cards())}), card file or checkpoint folder"
    if world_problem := _world_problem(args):
        yield world_problem


def _world_problem(args: argparse.Namespace) -> Optional[str]:
    """Whether the processes that torchrun started (one without it) split into model replicas of
    --tp x --pp x --cp ranks (the expert layout is checked when the model is built)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    replica = args.tp * args.pp * args.cp
    if min(args.tp, args.pp, args.cp) < 1 or world % replica == 0:
        return None
    sizes = " ".join(f"--{name} {getattr(args, name)}" for name in ("tp", "pp", "cp") if getattr(args, name) > 1)
    return (f"{sizes}: a model replica spans {replica} processes, and this run has {world}; launch a multiple of "
            f"{replica}, e.g. torchrun --nproc-per-node {replica} examples/grpo_policy_update.py ...")


def _tokens_or_auto(text: str):
    return AUTO if text == AUTO else int(text)


def _tokenizer_path(text: str) -> Path:
    if not text:  # Path("") is the current folder, which transformers would try to read as a tokenizer
        raise argparse.ArgumentTypeError("an empty path; pass a SentencePiece .model, a Hugging Face tokenizer.json "
                                         "or model folder, or leave the flag out")
    return Path(text)


if __name__ == "__main__":
    parse_args()  # bad flags are refused before the imports below, which take seconds

# Megatron-Core and the parts of this library built on it
import torch.distributed as dist  # noqa: E402
from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from tqdm import tqdm  # noqa: E402

from megatron_dualkv import (  # noqa: E402
    CostModel, PlannedMicroBatch, RolloutGroup, Trajectory, held_path_len, pack_trajectories, trajectory_groups,
)
from megatron_dualkv.mcore import ParallelSizes, use_fused_adam  # noqa: E402
from megatron_dualkv.mcore.parallel import current_parallel_sizes, micro_batch_token_multiple  # noqa: E402
from megatron_dualkv.memory import DEFAULT_MARGIN, Fit, MemoryModel, device_budget, use_expandable_segments  # noqa: E402
from megatron_dualkv.models import (  # noqa: E402
    ModelCard, architecture_differences, build_model, checkpoint_card, load_card, load_megatron_state_dict, load_model,
    weights_only,
)
from megatron_dualkv.models.builder import param_dtype  # noqa: E402
from megatron_dualkv.rl import (  # noqa: E402
    DAPOLoss, GRPOLoss, MiniBatch, PPOUpdate, PrefixReuseBatch, RLMicroBatch, RLStepOutput, ResponseTokens, forward_only,
    plan_mini_batches, ppo_updates,
)
from megatron_dualkv.run_log import RunLog  # noqa: E402

LOSSES = {"grpo": GRPOLoss(), "dapo": DAPOLoss()}


# --------------------------------------------------------------------------------------- rollouts
def read_run_rollouts(args: argparse.Namespace, vocab_size: int) -> Rollouts:
    """The rollout file of --rollouts, checked against the flags that need its log-probs."""
    rollouts = read_rollouts(args.rollouts, vocab_size, rollout_tokenizer(args))
    if args.tis_cap is not None and rollouts.logprobs is None:
        raise InputError(f"--tis-cap needs the inference engine's log-probs: {args.rollouts} has no 'logprobs'")
    return rollouts


def rollout_tokenizer(args: argparse.Namespace) -> Optional[Path]:
    """The tokenizer of text rollouts: --tokenizer; else --model's own (its folder's, or that of its
    config.json); else, for the bundled sample rollouts, the bundled sample tokenizer (which
    ``load_tokenizer`` refuses for any vocabulary but the tiny cards'). None: text is refused, never
    tokenized by another model's tokenizer."""
    if args.tokenizer is not None:
        return args.tokenizer
    model = Path(args.model)
    if model.is_dir() or model.name == "config.json":
        own = find_tokenizer(model if model.is_dir() else model.parent)
        if own is not None:
            return own
    return SAMPLE_TOKENIZER if args.rollouts.resolve().parent == DATA else None


def step_indices(num_groups: int, step: int, global_batch_size: int) -> List[int]:
    """The rollout groups of ``step`` (1-based): the next ``global_batch_size`` of the file, cycling."""
    first = (step - 1) * global_batch_size
    return [(first + i) % num_groups for i in range(global_batch_size)]


Rollout = Union[RolloutGroup, List[Trajectory]]  # a group: of a prompt and its responses, or of trajectories


def file_groups(rollouts: Rollouts) -> List[Rollout]:
    """The groups of a rollout file: its rollout groups, or its trajectories by group (``trajectory_groups``)."""
    if rollouts.trajectories is None:
        return rollouts.groups
    return [[rollouts.trajectories[i] for i in members] for members in trajectory_groups(rollouts.trajectories)]


def step_rollouts(groups: List[Rollout], index: List[int]) -> Union[List[RolloutGroup], List[Trajectory]]:
    """The step's rollout groups, or its trajectories group by group, each group's id its place in
    the step (a group that the step takes twice is two groups, as a rollout group is)."""
    if isinstance(groups[0], RolloutGroup):
        return [groups[i] for i in index]
    return [dataclasses.replace(t, group=k) for k, i in enumerate(index) for t in groups[i]]


def group_rewards(rollouts: Union[List[RolloutGroup], List[Trajectory]]) -> List[torch.Tensor]:
    """Per group, the rewards of its responses (trajectories): what the loss's advantages take."""
    if isinstance(rollouts[0], RolloutGroup):
        return [torch.tensor(g.rewards) for g in rollouts]
    return [torch.tensor([rollouts[i].reward for i in members]) for members in trajectory_groups(rollouts)]


# ------------------------------------------------------------------------------ model and optimizer
@dataclass
class Policy:
    """The DDP-wrapped model, its optimizer and learning-rate scheduler, and what FLOP counting and packing need."""

    model: DistributedDataParallel
    optimizer: object
    scheduler: OptimizerParamScheduler
    cost: CostModel
    card: str
    vocab_size: int
    token_multiple: int


def fit_to_memory(args: argparse.Namespace, groups: List[Rollout]) -> Optional[Fit]:
    """Resolve --recompute auto and --max-tokens auto in ``args`` (None when neither is auto) within the
    GPU's memory less --memory-margin (``fit_within``)."""
    if AUTO not in (args.recompute, args.max_tokens):
        return None
    if not torch.cuda.is_available():
        raise InputError("--recompute auto and --max-tokens auto fit the micro-batch to the GPU's memory: they need CUDA")
    args.memory_margin = DEFAULT_MARGIN if args.memory_margin is None else args.memory_margin
    return fit_within(args, groups, device_budget(margin=args.memory_margin))


def fit_within(args: argparse.Namespace, groups: List[Rollout], budget: float) -> Fit:
    """Resolve --recompute auto and --max-tokens auto in ``args`` with the memory model, within ``budget``
    bytes, and the predicted peak of the resolved setting. Packed: the least recompute under which a
    micro-batch holds the largest rollout group whole (else the longest prompt plus response), and the
    most packed tokens that setting fits. Replicated, which shares no prompt to keep whole: of no
    recompute and selective (neither re-runs a matmul), the one that runs the largest micro-batches,
    else the least recompute that runs the longest prompt plus response; each micro-batch as the steps
    plan it by packed tokens and then run it replicated (``replicated_micro_batch``)."""
    card = model_card(args)
    sizes = ParallelSizes(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp)
    world = int(os.environ.get("WORLD_SIZE", 1))
    dp = max(1, world // sizes.model_ranks)
    memory = MemoryModel.for_card(card, sizes, param_dtype(card, DTYPES[args.dtype] if args.dtype else None),
                                  dp=dp, distributed_optimizer=args.use_distributed_optimizer,
                                  ref_model=args.ref_load is not None, transformer_engine=_transformer_engine(args),
                                  fp8=args.fp8 != "off", offload=args.offload)
    whole, longest, responses = packed_sizes(groups)
    replicated, multiple = args.layout == "replicated", micro_batch_token_multiple(sizes, args.fp8 != "off")
    if replicated:
        attention_weight = CostModel.from_config(memory.config, memory.vocab_size).attention_weight
        micro_batch = replicated_micro_batch(args, groups, dp, attention_weight, multiple)
    else:
        micro_batch = lambda n: (n, int(n * responses))  # noqa: E731
    # a pipeline's first stage holds pp micro-batches at once (1F1B), however many a step has
    shape = dict(num_micro_batches=sizes.pp, layout=args.layout, micro_batch=micro_batch)
    setting = {} if args.recompute == AUTO else dict(recompute=args.recompute, recompute_layers=args.recompute_layers)
    needs = (args.max_tokens,) if args.max_tokens != AUTO else (longest,) if replicated else (whole, longest)
    for need in needs:
        try:
            if replicated and args.recompute == args.max_tokens == AUTO:
                fit = _largest_cheap_fit(memory, budget, need, multiple=multiple, **shape)
            else:
                fit = memory.fit_holding_prompt(budget, need, held_prompt_tokens=held_prompt(args, groups, need),
                                                multiple=multiple, **setting, **shape)
            break
        except ValueError as err:
            problem = err
    else:
        raise InputError(str(problem))
    args.recompute, args.recompute_layers = fit.recompute, fit.recompute_layers
    args.prompt_on_host = fit.prompt_on_host
    if args.max_tokens == AUTO:
        args.max_tokens = fit.tokens
    return memory.fit_at(args.max_tokens, fit.recompute, fit.recompute_layers, **shape,
                         held_prompt_tokens=held_prompt(args, groups, args.max_tokens),
                         prompt_on_host=fit.prompt_on_host)


def held_prompt(args: argparse.Namespace, groups: List[Rollout], max_tokens: int) -> int:
    """The longest prompt (a split tree's shared path) that prefix reuse holds with a budget of
    ``max_tokens`` (0: none; --prefix-reuse as ``resolve_prefix_reuse`` leaves it, True where it runs)."""
    if args.prefix_reuse is not True:
        return 0
    if isinstance(groups[0], RolloutGroup):
        return max((len(g.prompt) for g in groups if len(g.prompt) + sum(map(len, g.responses)) > max_tokens),
                   default=0)
    # the planner's trees: a group's trajectories by their first token
    trees = [[t for t in g if t.tokens[0] == first] for g in groups for first in {t.tokens[0] for t in g}]
    return max((held_path_len(tree) for tree in trees if pack_trajectories(tree).num_tokens > max_tokens), default=0)


def _largest_cheap_fit(memory: MemoryModel, budget: float, need: int, **shape) -> Fit:
    """Of no recompute and selective, the fit with the largest micro-batch (ties: no recompute), as the
    benchmark ranks the replicated layout's settings (fewest executed FLOPs, then the larger
    micro-batch); else the least recompute of the ladder that fits ``need``."""
    fits = []
    for mode in ("none", "selective"):
        try:
            fits.append(memory.fit(budget, need, recompute=mode, **shape))
        except ValueError:
            continue
    if not fits:
        return memory.fit(budget, need, **shape)
    return max(fits, key=lambda fit: fit.micro_batch_tokens)


def replicated_micro_batch(args: argparse.Namespace, groups: List[Rollout], dp_size: int, attention_weight: float,
                           token_multiple: int) -> Callable[[int], Tuple[int, int]]:
    """For a --max-tokens budget (packed tokens), the largest micro-batch on the replicated layout of any
    rank in the run's steps, as (tokens, rows predicting a trained token): what the memory model sizes."""
    @functools.lru_cache(maxsize=None)
    def largest(max_tokens: int) -> Tuple[int, int]:
        planned = planned_micro_batches(args, groups, max_tokens, dp_size, attention_weight)
        return max(replicated_size(mb, token_multiple) for mb in planned if not mb.is_padding)

    return largest


def planned_micro_batches(args: argparse.Namespace, groups: List[Rollout], max_tokens: int, dp_size: int,
                          attention_weight: float) -> Iterable[PlannedMicroBatch]:
    """Every rank's micro-batches of steps 1 to --steps as ``policy_update_step`` plans them with
    ``max_tokens`` (after as many steps as the file's groups take to line up again, the steps repeat)."""
    period = len(groups) // math.gcd(len(groups), args.global_batch_size)
    for step in range(1, min(args.steps, period) + 1):
        rollouts = step_rollouts(groups, step_indices(len(groups), step, args.global_batch_size))
        no_advantages = torch.zeros(sum(len(rewards) for rewards in group_rewards(rollouts)))
        for mini in plan_mini_batches(rollouts, args.mini_batches, max_tokens, no_advantages, dp_size=dp_size,
                                      attention_weight=attention_weight, prefix_reuse=args.prefix_reuse is True):
            yield from (mb for rank in mini.plan.ranks for mb in rank)


def replicated_size(mb: PlannedMicroBatch, multiple: int) -> Tuple[int, int]:
    """(tokens, rows predicting a trained token) of a planned micro-batch as the replicated layout runs it
    (``rl.logprobs``): a sequence per response after its prompt copy (per trajectory), all right-padded
    to the longest, a multiple of ``multiple``; a row per trained token (never a trajectory's first)."""
    if mb.trajectories:
        lengths = [len(t.tokens) for t in mb.trajectories]
        rows = sum(len(t.tokens) - 1 if t.loss_mask is None else sum(map(bool, t.loss_mask[1:])) for t in mb.trajectories)
    else:
        lengths = [len(g.prompt) + len(r) for g in mb.groups for r in g.responses]
        rows = sum(len(r) for g in mb.groups for r in g.responses)
    return len(lengths) * (-(-max(lengths) // multiple) * multiple), int(rows)


def packed_sizes(groups: List[Rollout]) -> Tuple[int, int, float]:
    """(packed tokens of the largest group, of the longest prompt with a response or trajectory,
    share of the packed tokens that a trained token is predicted from) of the file's groups."""
    if isinstance(groups[0], RolloutGroup):
        whole = max(len(g.prompt) + sum(map(len, g.responses)) for g in groups)
        longest = max(len(g.prompt) + max(map(len, g.responses)) for g in groups)
        packed = sum(len(g.prompt) + sum(map(len, g.responses)) for g in groups)
        return whole, longest, sum(sum(map(len, g.responses)) for g in groups) / packed
    batches = [pack_trajectories(g) for g in groups]
    predicted = sum(ResponseTokens.of(batch).num_predictions for batch in batches)
    return (max(batch.num_tokens for batch in batches), max(len(t.tokens) for g in groups for t in g),
            predicted / sum(batch.num_tokens for batch in batches))


def prefix_reuse_blockers(args: argparse.Namespace) -> List[str]:
    """What keeps prefix reuse (``rl.prefix_reuse``) from running with these flags, as flags name it."""
    return [what for bad, what in (
        (args.layout != "packed", f"--layout {args.layout}"),
        (_transformer_engine(args), "the Transformer Engine spec")) if bad]


def resolve_prefix_reuse(args: argparse.Namespace) -> None:
    """--prefix-reuse as a bool in ``args``: auto is on where prefix reuse runs, on where it does not
    is an error naming what is in the way (``prefix_reuse_blockers``)."""
    unsupported = prefix_reuse_blockers(args)
    if args.prefix_reuse == "on" and unsupported:
        raise InputError(f"--prefix-reuse on does not run with {', '.join(unsupported)} yet; use --prefix-reuse off")
    args.prefix_reuse = args.prefix_reuse != "off" and not unsupported


def plan_summary(args: argparse.Namespace, groups: List[Rollout], dp_size: int, attention_weight: float) -> str:
    """What step 1's plan does with the groups over --max-tokens: none, prefix reuse or sub-groups."""
    rollouts = step_rollouts(groups, step_indices(len(groups), 1, args.global_batch_size))
    no_advantages = torch.zeros(sum(len(rewards) for rewards in group_rewards(rollouts)))
    minis = plan_mini_batches(rollouts, args.mini_batches, args.max_tokens, no_advantages, dp_size=dp_size,
                              attention_weight=attention_weight, prefix_reuse=args.prefix_reuse)
    # a group in more than one micro-batch is split
    planned = [(j, mb) for j, mini in enumerate(minis) for rank in mini.plan.ranks for mb in rank]
    counts = collections.Counter((j, g) for j, mb in planned for g in mb.source_groups)
    split = [key for key, count in counts.items() if count > 1]
    if not split:
        return f"plan: every group in one micro-batch of at most {args.max_tokens:,} tokens"
    reused = {(j, g) for j, mb in planned if mb.shared_prompt is not None for g in mb.source_groups}
    trees = not isinstance(groups[0], RolloutGroup)
    ways = {True: "prefix reuse (its shared path runs once)" if trees else "prefix reuse (its prompt runs once)",
            False: "parts (each carries its path)" if trees else "sub-groups (each carries its prompt)"}
    by_way = collections.Counter(key in reused for key in split)
    if len(by_way) == 1:
        how = f"as {ways[next(iter(by_way))]}"
    else:  # some split groups hold no prompt or path (a tree trained from its first tokens)
        how = "; ".join(f"{by_way[way]} as {ways[way]}" for way in (True, False))
    groups_over = f"{len(split)} group{'s' * (len(split) > 1)}"
    line = (f"plan: {groups_over} over --max-tokens {args.max_tokens:,} in {sum(counts[key] for key in split)} "
            f"micro-batches, {how}")
    if by_way[False] and args.layout == "packed" and prefix_reuse_blockers(args):
        # the user runs the slower split without having asked for it: say what would hold the prompt
        line += "; prefix reuse does not run on the Transformer Engine spec yet (--transformer-engine off runs it)"
    return line


def check_token_budget(args: argparse.Namespace, groups: List[Rollout]) -> None:
    """--max-tokens holds the longest prompt with one of its responses (or trajectory): the planner
    splits a group between micro-batches, never a response."""
    longest = packed_sizes(groups)[1]
    if args.max_tokens < longest:
        raise InputError(
            f"--max-tokens {args.max_tokens:,} is less than the longest prompt with one of its responses "
            f"(or trajectory) in {args.rollouts.name}, {longest:,} tokens; raise --max-tokens to at least {longest:,}"
        )


def build_policy(args: argparse.Namespace) -> Policy:
    """Megatron model (``build_model``), DDP, Megatron's optimizer and scheduler, wired as Megatron's
    training loop wires them."""
    on_gpu = torch.cuda.is_available()
    if args.use_distributed_optimizer and not on_gpu:
        raise InputError("--use-distributed-optimizer needs CUDA: Megatron's DistributedOptimizer accepts CUDA parameters only")
    clip_grad = (1.0 if on_gpu else 0.0) if args.clip_grad is None else args.clip_grad
    if clip_grad and not on_gpu:
        raise InputError("--clip-grad needs CUDA (Megatron's gradient clipping asserts CUDA tensors); use 0 on CPU")
    model = _build_or_load_model(args)
    config = model.config
    if (config.bf16 or config.fp16) and not on_gpu:
        raise InputError(f"{args.model} is {config.params_dtype}: Megatron's mixed-precision optimizer needs CUDA; pass --dtype float32")
    vocab_size = model.unpadded_vocab_size  # what token ids are checked against
    cost = CostModel.from_config(config, model.vocab_size)  # the output layer computes its padded rows too
    token_multiple = micro_batch_token_multiple(current_parallel_sizes(config), config.fp8)
    # No Float16Module around a bf16 model: it would upcast the last stage's output (the final
    # hidden states, [tokens, hidden]) to fp32, which the log-prob code casts back to bf16.
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=args.use_distributed_optimizer)
    ddp = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, clip_grad=clip_grad,
            bf16=config.bf16, fp16=config.fp16, params_dtype=config.params_dtype,
            use_distributed_optimizer=args.use_distributed_optimizer,
        ),
        [ddp],
    )
    use_fused_adam(optimizer)
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return Policy(ddp, optimizer, build_lr_scheduler(optimizer, args), cost, args.model, vocab_size, token_multiple)


def build_lr_scheduler(optimizer, args: argparse.Namespace) -> OptimizerParamScheduler:
    """Megatron's scheduler as its training loop sets it up (warmup from 0, then the decay style),
    counting steps (rollout batches). The decay length: --lr-decay-steps, else that of the
    checkpoint being resumed, else --steps."""
    decay_steps = args.lr_decay_steps
    if decay_steps is None and args.load is not None:
        decay_steps = _load_common_state(args.load)[1]["opt_param_scheduler"]["lr_decay_steps"]
    decay_steps = decay_steps or args.steps
    if decay_steps <= args.lr_warmup_steps:
        raise InputError(f"the learning rate decays over {decay_steps} steps, not more than --lr-warmup-steps "
                         f"{args.lr_warmup_steps}: pass a larger --lr-decay-steps")
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_steps,
        lr_decay_steps=decay_steps, lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant",
        # a resumed run must ask for the checkpoint's schedule: checked with a clear error in load_checkpoint
        use_checkpoint_opt_param_scheduler=False,
    )


def _model_kwargs(args: argparse.Namespace) -> dict:
    return dict(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp, dtype=DTYPES[args.dtype] if args.dtype else None,
                seed=args.seed, use_transformer_engine=_transformer_engine(args), fp8=spec_kwargs(args)["fp8"])


def _transformer_engine(args: argparse.Namespace, card=None) -> bool:
    """Whether the run builds the Transformer Engine spec (--transformer-engine, checked) for ``card``
    (default --model's: a family without a TE spec builds the local one)."""
    try:
        return layer_spec(args, model_card(args) if card is None else card)[0]
    except (ImportError, ValueError) as err:
        raise InputError(f"--transformer-engine {args.transformer_engine}: {err}") from None


def spec_name(args: argparse.Namespace, card=None) -> str:
    """The layer spec the run builds for ``card`` (default --model's), as its first line names it."""
    return spec_label(_transformer_engine(args, card), spec_kwargs(args)["fp8"])


def _build_or_load_model(args: argparse.Namespace):
    """--model: a converted Megatron checkpoint folder (its weights, ``load_model``) or a card (random weights)."""
    # the reference policy runs forward only: recompute is the policy's alone
    kwargs = dict(_model_kwargs(args), recompute=args.recompute, recompute_layers=args.recompute_layers)
    if args.prompt_on_host:
        kwargs["prefix_reuse_prompt_on_host"] = True
    try:
        if Path(args.model).is_dir():
            return load_model(args.model, **kwargs)
        return build_model(args.model, **kwargs)
    except ValueError as err:  # Megatron-Core's and build_model's checks of the sizes against the model
        sizes = " ".join(f"--{name} {getattr(args, name)}" for name in ("tp", "pp", "ep", "cp"))
        raise InputError(f"--model {args.model} at {sizes}: {err}") from None


def build_reference(args: argparse.Namespace):
    """The frozen reference policy of --ref-load (None without it): ``load_model`` at the policy's
    parallel sizes and dtype. Memory: its weights only (no gradients, no optimizer state)."""
    if args.ref_load is None:
        return None
    card = model_card(args)
    differences = architecture_differences(card, checkpoint_card(args.ref_load))
    if differences:
        shown = ", ".join(f"{name} {ours!r} vs {theirs!r}" for name, (ours, theirs) in list(differences.items())[:4])
        raise InputError(f"--ref-load {args.ref_load} holds another architecture than --model {args.model}: {shown}"
                         + (f" (+{len(differences) - 4} more)" if len(differences) > 4 else ""))
    reference = load_model(args.ref_load, **_model_kwargs(args))
    reference.eval()
    reference.requires_grad_(False)
    return reference


def make_loss(args: argparse.Namespace):
    return dataclasses.replace(LOSSES[args.loss], kl_coef=args.kl_coef, clip_ratio_c=args.clip_ratio_c, tis_cap=args.tis_cap)


# ----------------------------------------------------------------------------------------- a step
@dataclass(frozen=True)
class PPOSchedule:
    """Optimizer steps per rollout batch: ``mini_batches`` x ``epochs``."""

    mini_batches: int = 1
    epochs: int = 1


@dataclass
class UpdateStats:
    """One optimizer step, over all ranks (token metrics: means over the mini-batch's response tokens)."""

    epoch: int
    mini_batch: int
    loss: float
    ratio: float
    clip_fraction: float
    dual_clip_fraction: Optional[float]
    kl: Optional[float]
    rollout_mismatch: Optional[float]
    seconds: float


@dataclass
class StepStats:
    """One step, over all ranks: ``flops`` are the model FLOPs of the whole step (every DP replica's
    micro-batches, every pass), ``rollout_tokens`` its tokens in the replicated count; token metrics
    are means over the step's response tokens (all its updates)."""

    loss: float
    reward: float
    margin: float
    clip_fraction: float
    rollout_tokens: int
    rho: float
    micro_batches: int
    dp_size: int
    flops: float
    seconds: float
    peak_memory_gib: float
    ratio: float = 1.0
    dual_clip_fraction: Optional[float] = None
    kl: Optional[float] = None
    entropy: Optional[float] = None
    rollout_mismatch: Optional[float] = None
    lr: Optional[float] = None
    updates: List[UpdateStats] = field(default_factory=list)


# per-response metrics of RLStepOutput that the step logs as token means
TOKEN_METRICS = ("ratio_mean", "clip_fraction", "dual_clip_fraction", "kl", "rollout_mismatch", "entropy")


def policy_update_step(policy: Policy, groups: Union[List[RolloutGroup], List[Trajectory]], loss_fn, max_tokens: int,
                       layout: str,
                       ppo: PPOSchedule = PPOSchedule(), reference=None,
                       rollout_logprobs: Optional[List[List[torch.Tensor]]] = None,
                       prefix_reuse: bool = False) -> StepStats:
    """The ``ppo.mini_batches x ppo.epochs`` optimizer steps of ``loss_fn`` on the rollout batch
    ``groups`` (all DP ranks' rollouts; this rank runs its share): rollout groups, or trajectories
    whose ``group`` ids number their groups (``step_rollouts``).

    rollout_logprobs: the inference engine's, per group, per response: the behaviour log-probs
    (no forward pass) unless ``loss_fn.tis_cap`` is set, then beside them for its correction.
    prefix_reuse: groups (trees) over ``max_tokens`` run their prompt (shared path) once (--prefix-reuse).
    """
    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    # Group-normalised advantages of whole groups: a group split over micro-batches or ranks
    # keeps the advantages it would have had in one piece.
    rewards = group_rewards(groups)
    advantages = loss_fn.advantages(rewards)
    minis = plan_mini_batches(groups, ppo.mini_batches, max_tokens, advantages, dp_size=dp_size, dp_rank=dp_rank,
                              attention_weight=policy.cost.attention_weight, pad_to_multiple_of=policy.token_multiple,
                              prefix_reuse=prefix_reuse)
    bypass = rollout_logprobs is not None and loss_fn.tis_cap is None
    # one update: the policy it updates is the behaviour policy, whose log-probs its own forward gives
    on_policy = not bypass and ppo.mini_batches == ppo.epochs == 1
    lr = policy.optimizer.param_groups[0]["lr"]
    _reset_peak_memory()
    start = _now()
    minis, behaviour = _with_logprobs(policy, minis, layout, reference, rollout_logprobs, bypass, on_policy)
    updates, update_sums, first_update = [], [], None
    mark = _now()
    # entropies: the behaviour pass's, else those of the first epoch's updates
    for update in ppo_updates(policy.model, policy.optimizer, minis, loss_fn, ppo.epochs, layout=layout,
                              with_entropy=behaviour is None):
        update_sums.append(_dp_sum(_metric_sums(zip(update.mini_batch.micro_batches, update.outputs))))
        updates.append(_update_stats(update, update_sums[-1], dp_size, _now() - mark))
        first_update = first_update or update
        mark = _now()
    seconds = _now() - start
    step_sums = torch.stack(update_sums).sum(0)
    metrics = _token_means(step_sums)
    entropy_sums = step_sums if behaviour is None else _dp_sum(_metric_sums(
        (mb, out) for mini, outs in zip(minis, behaviour) for mb, out in zip(mini.micro_batches, outs)))
    passes = (behaviour is not None) + (reference is not None) + 3 * ppo.epochs  # forward-only, then forward+backward
    # the behaviour log-probs, for the margin: on-policy the first (only) update's own
    behaviour_logprobs = (zip(first_update.mini_batch.micro_batches, (out.logprobs for out in first_update.outputs))
                          if on_policy else ((mb, mb.old_logprobs) for mini in minis for mb in mini.micro_batches))
    totals = _dp_sum(torch.tensor([*_margin_sums(behaviour_logprobs), passes * _forward_flops(policy.cost, minis, layout)]))
    pos, n_pos, neg, n_neg, flops = totals.tolist()
    return StepStats(
        loss=sum(u.loss for u in updates) / len(updates),
        reward=torch.cat(rewards).mean().item(),
        margin=pos / max(n_pos, 1) - neg / max(n_neg, 1),
        clip_fraction=metrics["clip_fraction"],
        rollout_tokens=sum(mini.plan.rollout_tokens for mini in minis),
        rho=sum(mini.plan.rollout_tokens for mini in minis) / sum(mini.plan.packed_tokens for mini in minis),
        micro_batches=sum(mini.plan.num_micro_batches for mini in minis),
        dp_size=dp_size,
        flops=flops,
        seconds=seconds,
        peak_memory_gib=_peak_memory_gib(),
        ratio=metrics["ratio_mean"],
        dual_clip_fraction=metrics["dual_clip_fraction"],
        kl=metrics["kl"],
        entropy=_token_means(entropy_sums)["entropy"],
        rollout_mismatch=metrics["rollout_mismatch"],
        lr=lr,
        updates=updates,
    )


def _with_logprobs(policy: Policy, minis: List[MiniBatch], layout: str, reference, rollout_logprobs, bypass: bool,
                   on_policy: bool) -> Tuple[List[MiniBatch], Optional[List[List[RLStepOutput]]]]:
    """The mini-batches with the log-probs their loss needs, all from before the first update: the
    behaviour pass's (with entropies; the rollouts' in ``bypass``; the update's own ``on_policy``),
    the reference's, the rollouts' for the importance weights; and the behaviour pass's outputs
    (None when skipped)."""
    behaviour = None if bypass or on_policy else forward_only(policy.model, minis, layout, with_entropy=True)
    references = None if reference is None else forward_only(reference, minis, layout)
    rollout = None if rollout_logprobs is None else [mini.share(rollout_logprobs) for mini in minis]
    minis = [
        mini.with_logprobs(
            old=rollout[j] if bypass else None if on_policy else [out.logprobs for out in behaviour[j]],
            ref=None if references is None else [out.logprobs for out in references[j]],
            rollout=None if bypass or rollout is None else rollout[j],
            on_policy=on_policy,
        )
        for j, mini in enumerate(minis)
    ]
    return minis, behaviour


def _metric_sums(micro_batches: Iterable[Tuple[RLMicroBatch, RLStepOutput]]) -> torch.Tensor:
    """[sum of the micro-batch losses, then per TOKEN_METRICS name its token-weighted sum and
    token count] over this rank's real micro-batches (float64, where the outputs are): the same
    length on every rank."""
    total = torch.zeros(1 + 2 * len(TOKEN_METRICS), dtype=torch.float64)
    for mb, out in micro_batches:
        if mb.is_padding:
            continue
        lens = ResponseTokens.of(_loss_batch(mb.batch), out.logprobs[0][0].device).lens.double()
        zero = lens.new_zeros(())
        row = [zero if out.loss is None else out.loss.double()]
        for name in TOKEN_METRICS:
            row += [(torch.cat(out.metrics[name]).double() * lens).sum(), lens.sum()] if name in out.metrics else [zero, zero]
        total = total.to(lens.device) + torch.stack(row)
    return total


def _token_means(sums: torch.Tensor) -> Dict[str, Optional[float]]:
    """The token means of ``_metric_sums`` (None: not measured on any rank)."""
    out = {}
    for i, name in enumerate(TOKEN_METRICS):
        total, count = sums[1 + 2 * i].item(), sums[2 + 2 * i].item()
        out[name] = total / count if count else None
    return out


def _update_stats(update: PPOUpdate, sums: torch.Tensor, dp_size: int, seconds: float) -> UpdateStats:
    means = _token_means(sums)
    return UpdateStats(
        epoch=update.epoch, mini_batch=update.index,
        loss=sums[0].item() / (update.mini_batch.plan.num_micro_batches * dp_size),
        ratio=means["ratio_mean"], clip_fraction=means["clip_fraction"], dual_clip_fraction=means["dual_clip_fraction"],
        kl=means["kl"], rollout_mismatch=means["rollout_mismatch"], seconds=seconds,
    )


def _margin_sums(behaviour_logprobs: Iterable[Tuple[RLMicroBatch, List[List[torch.Tensor]]]]) -> List[float]:
    """Of (micro-batch, its behaviour log-probs) pairs: the log-prob sums and counts of the responses
    with positive advantage, then of the others (responses with trained tokens: a trajectory may have none)."""
    sums = torch.zeros(4, dtype=torch.float64)
    for mb, logprobs in behaviour_logprobs:
        if mb.is_padding:
            continue
        responses = [r.double().cpu() for group in logprobs for r in group]
        trained = torch.tensor([r.numel() > 0 for r in responses])
        response_logp = torch.stack([r.mean() if r.numel() else r.new_zeros(()) for r in responses])
        positive = (mb.advantages.double().cpu() > 0) & trained
        negative = ~positive & trained
        sums += torch.stack([response_logp[positive].sum(), positive.sum(),
                             response_logp[negative].sum(), negative.sum()])
    return sums.tolist()


def _forward_flops(cost: CostModel, minis: List[MiniBatch], layout: str) -> float:
    """Forward FLOPs of this rank's real micro-batches of every mini-batch (one pass over the rollout batch),
    the output layer on the rows that predict a trained token only, as the log-probs compute it (once
    per packed token that trajectories share, once per copy in the replicated layout)."""
    def flops(batch) -> float:
        tokens = ResponseTokens.of(_loss_batch(batch))
        if layout != "packed":
            return cost.layout_flops(batch.replicated().layout, predicting_rows=tokens.num_tokens)
        # a prefix-reuse part: its responses (their pairs with the prompt included), and with the
        # first part the prompt's forward, which predicts no row itself
        prompt = (cost.layout_flops(batch.prompt.batch.layout, predicting_rows=0)
                  if isinstance(batch, PrefixReuseBatch) and batch.index == 0 else 0.0)
        return prompt + cost.layout_flops(batch.layout, predicting_rows=tokens.num_predictions)

    return sum(flops(mb.batch) for mini in minis for mb in mini.micro_batches if not mb.is_padding)


def _loss_batch(batch):
    """The batch whose responses the loss reads: a prefix-reuse part's stub (its prompt's last token)."""
    return batch.stub if isinstance(batch, PrefixReuseBatch) else batch


def _dp_sum(values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over the data-parallel ranks (float64, on the host)."""
    values = values.to(torch.float64)
    if torch.cuda.is_available():  # NCCL reduces device tensors only
        values = values.to(torch.cuda.current_device())
    dist.all_reduce(values, group=parallel_state.get_data_parallel_group())
    return values.cpu()


def _now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def _reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def measure_matmul_tflops(size: int = 8192, repeats: int = 20, device: str = "cuda", dtype=torch.bfloat16) -> float:
    """The matmul rate of this device (TFLOP/s; bf16 on the GPU by default), the MFU reference."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    start = _now()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (_now() - start) / 1e12


# ----------------------------------------------------------------------------------------- logging
def _optional_fields(values: Dict[str, Optional[float]]) -> str:
    return "".join(f" | {name} {value:.4f}" for name, value in values.items() if value is not None)


def format_stats(step: int, steps: int, stats: StepStats, peak_tflops: Optional[float]) -> str:
    tflops = stats.flops / stats.seconds / dist.get_world_size() / 1e12
    mfu = "n/a" if peak_tflops is None else f"{100 * tflops / peak_tflops:.1f}%"
    return (
        f"step {step:4d}/{steps} | loss {stats.loss:+.4e} | reward {stats.reward:.3f} | margin {stats.margin:+.4f} | "
        f"clip {stats.clip_fraction:.3f} | {stats.rollout_tokens / stats.seconds:,.0f} tok/s | rho {stats.rho:.2f} | "
        f"mb {stats.micro_batches}x{stats.dp_size} | mem {stats.peak_memory_gib:.2f} GiB | "
        f"{tflops:.4f} TFLOP/s | MFU {mfu} | {stats.seconds:.2f} s | lr {stats.lr:.3e} | ratio {stats.ratio:.4f}"
        + _optional_fields({"dual-clip": stats.dual_clip_fraction, "kl": stats.kl, "entropy": stats.entropy,
                            "mismatch": stats.rollout_mismatch})
    )


def _in_step(update: UpdateStats, ppo: PPOSchedule) -> int:
    """The update's number in its step, from 1."""
    return update.epoch * ppo.mini_batches + update.mini_batch + 1


def format_update(step: int, steps: int, update: UpdateStats, ppo: PPOSchedule) -> str:
    return (
        f"update {step:4d}.{_in_step(update, ppo)}/{steps} | "
        f"epoch {update.epoch + 1}/{ppo.epochs} | mini-batch {update.mini_batch + 1}/{ppo.mini_batches} | "
        f"loss {update.loss:+.4e} | ratio {update.ratio:.4f} | clip {update.clip_fraction:.3f}"
        + _optional_fields({"dual-clip": update.dual_clip_fraction, "kl": update.kl, "mismatch": update.rollout_mismatch})
        + f" | {update.seconds:.2f} s"
    )


def log_step(log: RunLog, step: int, stats: StepStats, ppo: PPOSchedule, peak_tflops: Optional[float]) -> None:
    """The step and its updates in --tensorboard-dir and --log-jsonl."""
    for update in stats.updates:
        number = (step - 1) * ppo.mini_batches * ppo.epochs + _in_step(update, ppo)  # in the run
        log.update(step, number, update.epoch + 1, update.mini_batch + 1, dict(
            loss=update.loss, ratio=update.ratio, clip_fraction=update.clip_fraction,
            dual_clip_fraction=update.dual_clip_fraction, kl=update.kl, rollout_mismatch=update.rollout_mismatch,
            seconds=update.seconds))
    tflops = stats.flops / stats.seconds / dist.get_world_size() / 1e12
    log.step(step, dict(
        loss=stats.loss, reward=stats.reward, margin=stats.margin, clip_fraction=stats.clip_fraction,
        dual_clip_fraction=stats.dual_clip_fraction, ratio=stats.ratio, kl=stats.kl, entropy=stats.entropy,
        rollout_mismatch=stats.rollout_mismatch, lr=stats.lr, tokens_per_s=stats.rollout_tokens / stats.seconds,
        tflops=tflops, mfu=None if peak_tflops is None else tflops / peak_tflops, rho=stats.rho,
        peak_memory_bytes=stats.peak_memory_gib * 2**30, seconds=stats.seconds))


# ------------------------------------------------------------------------------------ checkpoints
def _sharded_state_dict(policy: Policy, step: int, is_loading: bool) -> dict:
    model = policy.model.module.sharded_state_dict()
    return {
        # Loading asks for the weights alone: the checkpoint of a run of the other layer spec has no
        # Transformer Engine ``_extra_state`` (FP8 scaling state, which current scaling does not keep)
        "model": weights_only(model) if is_loading else model,
        "optimizer": policy.optimizer.sharded_state_dict(model, is_loading=is_loading),
        "opt_param_scheduler": policy.scheduler.state_dict(),  # Megatron's key for it
        "step": step,
        "card": policy.card,
        "expert_layout": _expert_layout(),
    }


def _expert_layout() -> dict:
    """The parallel sizes that shape Megatron's optimizer state: with experts split (ep, etp) it
    is a chain of a dense and an expert optimizer, which does not reshard into another layout."""
    sizes = current_parallel_sizes()
    return {"ep": sizes.ep, "etp": sizes.etp}


def save_checkpoint(directory: Path, step: int, policy: Policy) -> Path:
    """Model, optimizer, scheduler and step as a Megatron distributed checkpoint in ``directory/iter_<step>``."""
    if importlib.util.find_spec("psutil") is None:  # Megatron's writer needs it, and hangs without it
        raise InputError("--save needs psutil (Megatron's checkpoint writer): pip install psutil")
    path = directory / f"iter_{step:07d}"
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(policy, step, is_loading=False), str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        (directory / TRACKER).write_text(f"{step}\n")
    return path


def model_card(args: argparse.Namespace) -> ModelCard:
    """--model's card: a card name or file, or that of a converted checkpoint folder."""
    try:
        return checkpoint_card(args.model) if Path(args.model).is_dir() else load_card(args.model)
    except (ValueError, OSError) as err:
        raise InputError(f"--model {args.model}: {err}") from None


def _load_common_state(directory: Path) -> Tuple[Path, dict]:
    """The latest checkpoint in ``directory`` and its common (non-tensor) state."""
    tracker = directory / TRACKER
    if not tracker.is_file():
        raise InputError(f"no checkpoint to load: {tracker} does not exist")
    path = directory / f"iter_{int(tracker.read_text().strip()):07d}"
    common = dist_checkpointing.load_common_state_dict(str(path))
    if "opt_param_scheduler" not in common:
        raise InputError(f"{path} was saved before checkpoints held the learning-rate schedule; start a new run "
                         "from its weights (megatron_dualkv.models.save_model, then --model <that folder>)")
    return path, common


def load_checkpoint(directory: Path, policy: Policy) -> int:
    """Restore model, optimizer and scheduler from the latest checkpoint in ``directory``; the step it was saved at."""
    path, common = _load_common_state(directory)
    if common["card"] != policy.card:  # checked first: the tensors of another model would fail with shape errors
        raise InputError(f"{directory} holds a checkpoint of {common['card']!r}, not of --model {policy.card!r}")
    if common["expert_layout"] != _expert_layout():
        raise InputError(
            f"{directory} was saved with expert parallelism {common['expert_layout']}, this run has {_expert_layout()}: "
            "the optimizer state does not reshard across expert layouts; resume with the same --ep, or start a "
            "new run from the weights alone (megatron_dualkv.models.save_model, then --model <that folder>)"
        )
    _check_same_schedule(common["opt_param_scheduler"], policy.scheduler.state_dict(), directory)
    state = dist_checkpointing.load(_sharded_state_dict(policy, common["step"], is_loading=True), str(path))
    load_megatron_state_dict(policy.model.module, state["model"])
    policy.optimizer.load_state_dict(state["optimizer"])
    policy.scheduler.load_state_dict(common["opt_param_scheduler"])
    return state["step"]


def _check_same_schedule(saved: dict, ours: dict, directory: Path) -> None:
    """InputError naming the flags in which this run's schedule differs from the checkpoint's
    (Megatron's training loop asserts they match unless told which to use)."""
    differences = [f"{flag} {ours[name]} (checkpoint: {saved[name]})" for name, flag in SCHEDULE_FLAGS.items()
                   if ours[name] != saved[name]]
    if differences:
        raise InputError(f"{directory} was saved with another learning-rate schedule: this run has "
                         + ", ".join(differences) + "; resume with the flags of the saved run")


# ------------------------------------------------------------------------------------------- main
def train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    card = model_card(args)
    rollouts = read_run_rollouts(args, card.config["vocab_size"])
    groups = file_groups(rollouts)
    resolve_prefix_reuse(args)
    fit = fit_to_memory(args, groups)
    check_token_budget(args, groups)
    policy = build_policy(args)
    reference = build_reference(args)
    start = load_checkpoint(args.load, policy) if args.load else 0
    rank0 = dist.get_rank() == 0
    peak = args.peak_tflops if args.peak_tflops is not None else (measure_matmul_tflops() if torch.cuda.is_available() else None)
    loss_fn, ppo = make_loss(args), PPOSchedule(args.mini_batches, args.ppo_epochs)
    if rank0:
        params = sum(p.numel() for p in policy.model.module.parameters())
        print(f"model {args.model} ({params:,} parameters on rank 0) | spec {spec_name(args)} | layout {args.layout} | "
              f"loss {args.loss} | "
              f"world {dist.get_world_size()} (tp {args.tp} pp {args.pp} ep {args.ep} cp {args.cp}, "
              f"dp {parallel_state.get_data_parallel_world_size()}) | "
              + (f"{len(groups)} rollout groups" if rollouts.trajectories is None
                 else f"{len(rollouts.trajectories)} trajectories in {len(groups)} groups")
              + f" from {args.rollouts.name}"
              + ("" if rollouts.tokenizer is None else f" (tokenizer {_shown(rollouts.tokenizer)})")
              + (f" | {ppo.mini_batches} mini-batches x {ppo.epochs} epochs" if ppo.mini_batches * ppo.epochs > 1 else "")
              + (f" | reference {args.ref_load}" if reference is not None else "")
              + (f" | resumed at step {start}" if start else "")
              + ("" if peak is None else f" | peak {peak:.0f} TFLOP/s"), flush=True)
        print(plan_summary(args, groups, parallel_state.get_data_parallel_world_size(), policy.cost.attention_weight),
              flush=True)
        if fit is not None:
            print(f"memory: {fit.describe()}, within {device_budget(margin=args.memory_margin) / 2**30:.1f} GiB "
                  f"(the GPU less {100 * args.memory_margin:.0f}%)", flush=True)
    if start >= args.steps and rank0:
        print(f"the checkpoint is at step {start}: nothing to run up to --steps {args.steps}")
    log = RunLog(args.tensorboard_dir, args.log_jsonl, append=start > 0) if rank0 else None
    progress = tqdm(range(start + 1, args.steps + 1), initial=start, total=args.steps, unit="step", disable=not rank0)
    for step in progress:
        index = step_indices(len(groups), step, args.global_batch_size)
        stats = policy_update_step(
            policy, step_rollouts(groups, index), loss_fn, args.max_tokens, args.layout, ppo, reference,
            None if rollouts.logprobs is None else [rollouts.logprobs[i] for i in index], args.prefix_reuse,
        )
        policy.scheduler.step(1)
        if rank0:
            if len(stats.updates) > 1:
                for update in stats.updates:
                    progress.write(format_update(step, args.steps, update, ppo))
            progress.write(format_stats(step, args.steps, stats, peak))
            progress.set_postfix(loss=f"{stats.loss:.3e}", tok_s=f"{stats.rollout_tokens / stats.seconds:,.0f}")
            log_step(log, step, stats, ppo, peak)
        if args.save and (step == args.steps or (args.save_interval and step % args.save_interval == 0)):
            path = save_checkpoint(args.save, step, policy)
            if rank0:
                progress.write(f"saved {path}")
    if log is not None:
        log.close()


def _shown(path: Path) -> str:
    """``path`` relative to the working folder when it lies under it (the bundled files: examples/data/...)."""
    relative = os.path.relpath(path.resolve())
    return str(path) if relative.startswith("..") else relative


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    use_expandable_segments()
    try:
        train(args)
    except (InputError, RolloutFileError) as err:
        exit_with_error(str(err))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
