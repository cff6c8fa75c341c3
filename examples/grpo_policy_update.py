"""GRPO/DAPO policy update on Megatron-Core with the DualKV packed layout.

    python examples/grpo_policy_update.py                      # bundled defaults: qwen3-tiny on CPU, a few steps
    torchrun --nproc-per-node 2 examples/grpo_policy_update.py --tp 2
    python examples/grpo_policy_update.py --steps 4 --save ckpt
    python examples/grpo_policy_update.py --steps 8 --load ckpt --save ckpt   # resumes at step 5

Every step takes the next --global-batch-size rollout groups of --rollouts (cycling through the
file), plans packed micro-batches of at most --max-tokens tokens for the data-parallel ranks
(``megatron_dualkv.plan_micro_batches``), computes the behaviour log-probs with a forward-only run
of Megatron's schedule, runs Megatron's forward/backward schedule with the GRPO or DAPO loss
(advantages normalised over whole groups, the loss normalised over the whole batch), and steps
Megatron's optimizer. ``--layout replicated`` runs the same micro-batches on the standard layout
(every response after its own prompt copy): the same losses, for side-by-side checks.

Logged per step on rank 0: the loss; the mean reward of the step's rollouts; ``margin``, the mean
token log-prob of responses with positive advantage minus that of the others (before the update;
it grows as the policy learns the rewards); the clip fraction; rollout tokens per second (every
response with its prompt, as the replicated layout counts them, so both layouts compare); rho (the
token reduction of the packed plan); micro-batches per rank x DP ranks; peak memory (GPU:
allocated, CPU: process RSS); model TFLOP/s per device (forward of the behaviour log-probs plus
forward and backward of the update: 4x the forward FLOPs of the layout run, by
``megatron_dualkv.CostModel``) and MFU against --peak-tflops, or against the bf16 matmul rate
measured at start on a GPU; n/a on a CPU without --peak-tflops.

With one update per rollout batch the behaviour policy is the current one: the ratio is 1 and the
GRPO loss (sequence-mean of -A) is ~0 while its gradient is not.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tqdm import tqdm

from megatron_dualkv import CostModel, RolloutGroup, plan_micro_batches
from megatron_dualkv.mcore import use_fused_adam
from megatron_dualkv.mcore.parallel import current_parallel_sizes
from megatron_dualkv.models import build_model, load_model
from megatron_dualkv.rl import DAPOLoss, GRPOLoss, RLMicroBatch, forward_backward

DATA = Path(__file__).resolve().parent / "data"
LOSSES = {"grpo": GRPOLoss(), "dapo": DAPOLoss()}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's name for the last saved step


class InputError(ValueError):
    """A problem with the command line or the input files: reported without a traceback."""


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("model and parallelism")
    group.add_argument("--model", default="qwen3-tiny",
                       help="a model card (name in models/, card file or HF config.json: random weights) or a converted "
                            "Megatron checkpoint folder (tools/convert_checkpoint.py: its weights)")
    group.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="parameter dtype (default: the card's)")
    group.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    group.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    group.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    group.add_argument("--cp", type=int, default=1, help="context-parallel size (Ulysses)")
    group.add_argument("--layout", choices=["packed", "replicated"], default="packed")
    group.add_argument("--recompute", choices=["none", "selective", "full"], default="none",
                       help="activation recompute (build_model's recompute)")
    group.add_argument("--recompute-layers", type=int, default=None,
                       help="also recompute the first N layers of every pipeline stage whole")
    group = parser.add_argument_group("data")
    group.add_argument("--rollouts", type=Path, default=DATA / "rollouts.jsonl",
                       help="JSONL, one group a line: {prompt, responses, rewards}; token ids, or text with --tokenizer")
    group.add_argument("--tokenizer", type=Path, default=DATA / "tokenizer.model", help="SentencePiece model for text rollouts")
    group.add_argument("--global-batch-size", type=int, default=8, help="rollout groups per step, all DP ranks together")
    group.add_argument("--max-tokens", type=int, default=1024, help="micro-batch token budget (packed tokens)")
    group = parser.add_argument_group("training")
    group.add_argument("--loss", choices=sorted(LOSSES), default="grpo")
    group.add_argument("--lr", type=float, default=1e-3)
    group.add_argument("--weight-decay", type=float, default=0.0)
    group.add_argument("--clip-grad", type=float, default=None, help="gradient-norm clip (default 1.0 on GPU; CPU: 0, off)")
    group.add_argument("--use-distributed-optimizer", action="store_true", help="shard optimizer state over DP ranks (GPU)")
    group.add_argument("--steps", type=int, default=8, help="last step to run (a resumed run continues up to it)")
    group.add_argument("--seed", type=int, default=1234)
    group = parser.add_argument_group("checkpoints and logging")
    group.add_argument("--save", type=Path, default=None, help="directory for Megatron distributed checkpoints")
    group.add_argument("--save-interval", type=int, default=0, help="also save every N steps (0: at the end only)")
    group.add_argument("--load", type=Path, default=None, help="resume from the latest checkpoint in this directory")
    group.add_argument("--peak-tflops", type=float, default=None, help="per-device peak for MFU (default: measured on GPU)")
    args = parser.parse_args(argv)
    for name in ("global_batch_size", "max_tokens", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.rollouts.is_file():  # before the model is built
        parser.error(f"--rollouts: file not found: {args.rollouts}")
    return args


# --------------------------------------------------------------------------------------- rollouts
def load_tokenizer(path: Path, vocab_size: int):
    """The SentencePiece model at ``path``; InputError when missing or larger than the model's vocabulary."""
    import sentencepiece as spm

    if not path.is_file():
        raise InputError(f"tokenizer not found: {path}")
    tokenizer = spm.SentencePieceProcessor(model_file=str(path))
    if tokenizer.get_piece_size() > vocab_size:
        raise InputError(
            f"tokenizer {path} has {tokenizer.get_piece_size()} pieces, more than the model's vocab_size {vocab_size}"
        )
    return tokenizer


def read_rollouts(path: Path, vocab_size: int, tokenizer_path: Optional[Path]) -> List[RolloutGroup]:
    """One ``RolloutGroup`` per JSONL line ``{"prompt", "responses", "rewards"}``.

    Prompt and responses are all token-id lists or all text; text is tokenized with the
    SentencePiece model (prompt: BOS + text, response: text + EOS, as a finished sample ends).
    Errors name the file and line.
    """
    if not path.is_file():
        raise InputError(f"rollouts file not found: {path}")
    tokenizer = None
    groups = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"{where}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or not {"prompt", "responses", "rewards"} <= record.keys():
            raise InputError(f"{where}: expected an object with 'prompt', 'responses' and 'rewards'")
        prompt, responses, rewards = record["prompt"], record["responses"], record["rewards"]
        if not isinstance(responses, list) or not responses:
            raise InputError(f"{where}: 'responses' must be a non-empty list")
        if not isinstance(rewards, list) or len(rewards) != len(responses) or not all(_is_number(r) for r in rewards):
            raise InputError(f"{where}: 'rewards' must be a list of {len(responses)} numbers, one per response")
        if isinstance(prompt, str):
            if not all(isinstance(r, str) for r in responses):
                raise InputError(f"{where}: a text prompt needs text responses")
            if tokenizer is None:
                if tokenizer_path is None:
                    raise InputError(f"{where}: text rollouts need a SentencePiece model (--tokenizer)")
                tokenizer = load_tokenizer(tokenizer_path, vocab_size)
            prompt, responses = _tokenized(tokenizer, prompt, responses)
        for what, ids in (("prompt", prompt), *((f"response {i}", r) for i, r in enumerate(responses))):
            _check_token_ids(ids, vocab_size, f"{where}: {what}")
        groups.append(RolloutGroup(prompt, responses, [float(r) for r in rewards]))
    if not groups:
        raise InputError(f"{path}: no rollout groups")
    return groups


def _tokenized(tokenizer, prompt: str, responses: List[str]):
    bos = [tokenizer.bos_id()] if tokenizer.bos_id() >= 0 else []
    eos = [tokenizer.eos_id()] if tokenizer.eos_id() >= 0 else []
    return bos + tokenizer.encode(prompt), [tokenizer.encode(r) + eos for r in responses]


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_token_ids(ids, vocab_size: int, where: str) -> None:
    if not isinstance(ids, list) or not ids:
        raise InputError(f"{where}: expected a non-empty list of token ids (or text)")
    for x in ids:
        if isinstance(x, bool) or not isinstance(x, int):
            raise InputError(f"{where}: token ids must be integers, got {x!r}")
        if not 0 <= x < vocab_size:
            raise InputError(f"{where}: token id {x} is outside the model's vocabulary (vocab_size {vocab_size})")


def step_groups(groups: List[RolloutGroup], step: int, global_batch_size: int) -> List[RolloutGroup]:
    """The rollout groups of ``step`` (1-based): the next ``global_batch_size`` of the file, cycling."""
    first = (step - 1) * global_batch_size
    return [groups[(first + i) % len(groups)] for i in range(global_batch_size)]


# ------------------------------------------------------------------------------ model and optimizer
@dataclass
class Policy:
    """The DDP-wrapped model, its optimizer, and what FLOP counting and packing need."""

    model: DistributedDataParallel
    optimizer: object
    cost: CostModel
    card: str
    vocab_size: int
    token_multiple: int


def build_policy(args: argparse.Namespace) -> Policy:
    """Megatron model (``build_model``), DDP, and Megatron's optimizer, wired as Megatron's training loop wires them."""
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
    token_multiple = current_parallel_sizes(config).token_multiple
    # No Float16Module around a bf16 model: it would upcast the last stage's output (the final
    # hidden states, [tokens, hidden]) to fp32, which the log-prob code casts back to bf16.
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=args.use_distributed_optimizer)
    ddp = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=args.lr, weight_decay=args.weight_decay, clip_grad=clip_grad,
            bf16=config.bf16, fp16=config.fp16, params_dtype=config.params_dtype,
            use_distributed_optimizer=args.use_distributed_optimizer,
        ),
        [ddp],
    )
    use_fused_adam(optimizer)
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return Policy(ddp, optimizer, cost, args.model, vocab_size, token_multiple)


def _build_or_load_model(args: argparse.Namespace):
    """--model: a converted Megatron checkpoint folder (its weights, ``load_model``) or a card (random weights)."""
    kwargs = dict(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp, dtype=DTYPES[args.dtype] if args.dtype else None, seed=args.seed,
                  recompute=args.recompute, recompute_layers=args.recompute_layers)
    if Path(args.model).is_dir():
        return load_model(args.model, **kwargs)
    return build_model(args.model, **kwargs)


# ----------------------------------------------------------------------------------------- a step
@dataclass
class StepStats:
    """One step, over all ranks: ``flops`` are the model FLOPs of the whole step (every DP replica's
    micro-batches once), ``rollout_tokens`` its tokens in the replicated count."""

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


def policy_update_step(policy: Policy, groups: List[RolloutGroup], loss_fn, max_tokens: int, layout: str) -> StepStats:
    """One optimizer step of ``loss_fn`` on ``groups`` (all DP ranks' rollouts; this rank runs its share)."""
    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    plan = plan_micro_batches(groups, max_tokens, dp_size, policy.cost.attention_weight)
    planned = plan.ranks[dp_rank]
    batches = [mb.pack(pad_to_multiple_of=policy.token_multiple) for mb in planned]
    # Group-normalised advantages of whole groups: a group split over micro-batches or ranks
    # keeps the advantages it would have had in one piece.
    advantages = loss_fn.advantages([torch.tensor(g.rewards) for g in groups])
    loss_fn = dataclasses.replace(loss_fn, normalizer=plan.loss_normalizer(loss_fn.aggregation))
    _reset_peak_memory()
    start = _now()
    behaviour = forward_backward(policy.model, [RLMicroBatch(b) for b in batches], layout=layout)
    policy.model.zero_grad_buffer()
    policy.optimizer.zero_grad()
    selected = [mb.select_responses(advantages) for mb in planned]  # each micro-batch's share
    outputs = forward_backward(
        policy.model,
        [RLMicroBatch(b, old_logprobs=o.logprobs, advantages=a) for b, o, a in zip(batches, behaviour, selected)],
        loss_fn,
        layout=layout,
    )
    policy.optimizer.step()
    seconds = _now() - start
    real = [(a, b, o, out) for mb, a, b, o, out in zip(planned, selected, batches, behaviour, outputs) if not mb.is_padding]
    sums = torch.zeros(7, dtype=torch.float64)  # loss, logp+ sum/count, logp- sum/count, clipped, responses
    for selected_advantages, _, old, out in real:
        sums[0] += out.loss.item()
        response_logp = torch.stack([r.mean() for group in old.logprobs for r in group]).double().cpu()
        response_advantage = selected_advantages.double()
        positive = response_advantage > 0
        sums[1:5] += torch.stack([
            response_logp[positive].sum(), positive.sum(), response_logp[~positive].sum(), (~positive).sum()
        ])
        sums[5] += torch.cat(out.metrics["clip_fraction"]).double().sum().cpu()
        sums[6] += len(response_advantage)
    flops = sum(4 * policy.cost.layout_flops(b.layout if layout == "packed" else b.replicated().layout) for _, b, _, _ in real)
    sums = torch.cat([sums, torch.tensor([flops], dtype=torch.float64)])
    if torch.cuda.is_available():  # NCCL reduces device tensors only
        sums = sums.cuda()
    dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
    loss, pos, n_pos, neg, n_neg, clipped, responses, flops = sums.tolist()
    return StepStats(
        loss=loss / (plan.num_micro_batches * dp_size),
        reward=sum(sum(g.rewards) for g in groups) / sum(len(g.rewards) for g in groups),
        margin=pos / max(n_pos, 1) - neg / max(n_neg, 1),
        clip_fraction=clipped / responses,
        rollout_tokens=plan.rollout_tokens,
        rho=plan.rho,
        micro_batches=plan.num_micro_batches,
        dp_size=dp_size,
        flops=flops,
        seconds=seconds,
        peak_memory_gib=_peak_memory_gib(),
    )


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


def format_stats(step: int, steps: int, stats: StepStats, peak_tflops: Optional[float]) -> str:
    tflops = stats.flops / stats.seconds / dist.get_world_size() / 1e12
    mfu = "n/a" if peak_tflops is None else f"{100 * tflops / peak_tflops:.1f}%"
    return (
        f"step {step:4d}/{steps} | loss {stats.loss:+.4e} | reward {stats.reward:.3f} | margin {stats.margin:+.4f} | "
        f"clip {stats.clip_fraction:.3f} | {stats.rollout_tokens / stats.seconds:,.0f} tok/s | rho {stats.rho:.2f} | "
        f"mb {stats.micro_batches}x{stats.dp_size} | mem {stats.peak_memory_gib:.2f} GiB | "
        f"{tflops:.4f} TFLOP/s | MFU {mfu} | {stats.seconds:.2f} s"
    )


# ------------------------------------------------------------------------------------ checkpoints
def _sharded_state_dict(policy: Policy, step: int, is_loading: bool) -> dict:
    model = policy.model.module.sharded_state_dict()
    return {
        "model": model,
        "optimizer": policy.optimizer.sharded_state_dict(model, is_loading=is_loading),
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
    """Model, optimizer and step as a Megatron distributed checkpoint in ``directory/iter_<step>``."""
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


def load_checkpoint(directory: Path, policy: Policy) -> int:
    """Restore model and optimizer from the latest checkpoint in ``directory``; the step it was saved at."""
    tracker = directory / TRACKER
    if not tracker.is_file():
        raise InputError(f"no checkpoint to load: {tracker} does not exist")
    step = int(tracker.read_text().strip())
    path = str(directory / f"iter_{step:07d}")
    common = dist_checkpointing.load_common_state_dict(path)
    if common["card"] != policy.card:  # checked first: the tensors of another model would fail with shape errors
        raise InputError(f"{directory} holds a checkpoint of {common['card']!r}, not of --model {policy.card!r}")
    if common["expert_layout"] != _expert_layout():
        raise InputError(
            f"{directory} was saved with expert parallelism {common['expert_layout']}, this run has {_expert_layout()}: "
            "the optimizer state does not reshard across expert layouts; resume with the same --ep, or start a "
            "new run from the weights alone (megatron_dualkv.models.save_model, then --model <that folder>)"
        )
    state = dist_checkpointing.load(_sharded_state_dict(policy, step, is_loading=True), path)
    policy.model.module.load_state_dict(state["model"])
    policy.optimizer.load_state_dict(state["optimizer"])
    return state["step"]


# ------------------------------------------------------------------------------------------- main
def train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    policy = build_policy(args)
    groups = read_rollouts(args.rollouts, policy.vocab_size, args.tokenizer)
    start = load_checkpoint(args.load, policy) if args.load else 0
    rank0 = dist.get_rank() == 0
    peak = args.peak_tflops if args.peak_tflops is not None else (measure_matmul_tflops() if torch.cuda.is_available() else None)
    if rank0:
        params = sum(p.numel() for p in policy.model.module.parameters())
        print(f"model {args.model} ({params:,} parameters on rank 0) | layout {args.layout} | loss {args.loss} | "
              f"world {dist.get_world_size()} (tp {args.tp} pp {args.pp} ep {args.ep} cp {args.cp}, "
              f"dp {parallel_state.get_data_parallel_world_size()}) | {len(groups)} rollout groups from {args.rollouts.name}"
              + (f" | resumed at step {start}" if start else "")
              + ("" if peak is None else f" | peak {peak:.0f} TFLOP/s"), flush=True)
    if start >= args.steps and rank0:
        print(f"the checkpoint is at step {start}: nothing to run up to --steps {args.steps}")
    progress = tqdm(range(start + 1, args.steps + 1), initial=start, total=args.steps, unit="step", disable=not rank0)
    for step in progress:
        stats = policy_update_step(policy, step_groups(groups, step, args.global_batch_size), LOSSES[args.loss],
                                   args.max_tokens, args.layout)
        if rank0:
            progress.write(format_stats(step, args.steps, stats, peak))
            progress.set_postfix(loss=f"{stats.loss:.3e}", tok_s=f"{stats.rollout_tokens / stats.seconds:,.0f}")
        if args.save and (step == args.steps or (args.save_interval and step % args.save_interval == 0)):
            path = save_checkpoint(args.save, step, policy)
            if rank0:
                progress.write(f"saved {path}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    try:
        train(args)
    except InputError as err:
        raise SystemExit(f"error: {err}") from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
