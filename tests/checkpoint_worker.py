"""One rank of the checkpoint tests' multi-process runs (gloo on CPU), started by ``launch``.

Each scenario loads a converted checkpoint (``ROOT/<card>/megatron``) at its parallel sizes,
saves every rank's ``export_hf_weights`` and ``forward_logprobs`` of the ``SHAPES`` batch to
``ROOT/<scenario>.rank<r>.pt`` and saves the model back with ``save_model`` (Megatron's own
writer, the tensors split as the ranks hold them) to ``ROOT/<scenario>.saved``.
"""
from pathlib import Path
from typing import Dict, List, Tuple

import torch
import torch.multiprocessing as mp
from megatron.core import parallel_state

from gloo_world import join_world, new_rendezvous
from megatron_dualkv.models import checkpoint_card, export_hf_weights, load_model, save_model
from megatron_dualkv.rl import forward_logprobs
from rollouts import make_batch
from test_hf_state_dicts import SHAPES

SCENARIOS: Dict[str, Tuple[str, int, Dict]] = {  # name -> (card, world size, load_model arguments)
    "qwen3_tp2": ("qwen3-tiny", 2, dict(tp=2, sp=False)),
    "gemma3_tp2": ("gemma3-tiny", 2, dict(tp=2, sp=False)),
    "qwen3_moe_ep2": ("qwen3-moe-tiny", 2, dict(ep=2)),
    "qwen3_pp2": ("qwen3-tiny", 2, dict(pp=2)),
    # 3 layers over pp=2 (2 + 1), 300 tokens padded to 384 rows (512 at tp=2)
    "qwen3_uneven_pp2": ("qwen3-uneven", 2, dict(pp=2)),
    "qwen3_uneven_tp2": ("qwen3-uneven", 2, dict(tp=2)),
    # 5 layers over pp=2: sliding, full, sliding | full, sliding
    "gemma3_uneven_pp2": ("gemma3-uneven", 2, dict(pp=2)),
    # Gated DeltaNet heads split by tp: in_proj, the conv, A_log and dt_bias gathered along dim 0
    "qwen3_5_tp2": ("qwen3_5-tiny", 2, dict(tp=2)),
    # Ulysses CP: every rank holds every tensor whole, and the checkpoint stores one replica
    "qwen3_5_cp2": ("qwen3_5-tiny", 2, dict(cp=2)),
}


def run_rank(rank: int, world: int, rendezvous: str, root: str, scenarios: List[str]) -> None:
    join_world(rank, world, rendezvous)
    torch.set_num_threads(1)
    for name in scenarios:
        card, _, sizes = SCENARIOS[name]
        megatron_dir = Path(root) / card / "megatron"
        model = load_model(megatron_dir, **sizes)
        exported = {hf_name: tensor.clone() for hf_name, tensor in export_hf_weights(model, checkpoint_card(megatron_dir))}
        with torch.no_grad():
            logprobs = forward_logprobs(model, make_batch(SHAPES))
        torch.save(dict(exported=exported, logprobs=logprobs), Path(root) / f"{name}.rank{rank}.pt")
        save_model(model, checkpoint_card(megatron_dir), Path(root) / f"{name}.saved")
        parallel_state.destroy_model_parallel()


def launch(scenarios: List[str], world: int, root) -> None:
    """Run ``scenarios`` (all of world size ``world``) in one gloo world; a rank's exception is
    raised here with its traceback, and the other ranks are stopped."""
    mp.spawn(run_rank, args=(world, new_rendezvous(root), str(root), scenarios), nprocs=world, join=True)
