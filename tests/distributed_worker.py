"""One rank of test_rl_logprobs' two-process runs (gloo on CPU).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. python tests/distributed_worker.py {tp2|ep2} OUT_DIR

tp2: the tiny dense model at tp=2 (log-probs, GRPO gradients) and vocab_parallel_logprobs on a
shard of fixed logits. ep2: the tiny MoE model at ep=2 on the packed and replicated layouts.
Each rank saves its results to OUT_DIR/rank<r>.pt for the test to check.
"""
import os
import sys

import torch
from megatron.core import parallel_state

from megatron_dualkv.models import build_model
from megatron_dualkv.rl import GRPOLoss, RLMicroBatch, forward_backward, forward_logprobs, vocab_parallel_logprobs
from rollouts import make_batch, perturbed

VOCAB_LOGITS_SEED = 5


def fixed_logits_and_targets():
    g = torch.Generator().manual_seed(VOCAB_LOGITS_SEED)
    return 3 * torch.randn(7, 256, generator=g), torch.randint(0, 256, (7,), generator=g)


def tp2():
    model = build_model("qwen3-tiny", tp=2)
    batch = make_batch()
    packed = forward_logprobs(model, batch)
    replicated = forward_logprobs(model, batch, layout="replicated")
    forward_backward(model, [RLMicroBatch(batch, old_logprobs=perturbed(packed, 0.05))], GRPOLoss())
    logits, targets = fixed_logits_and_targets()
    rank = parallel_state.get_tensor_model_parallel_rank()
    shard = logits[:, rank * 128 : (rank + 1) * 128].clone().requires_grad_()
    logprobs, entropy = vocab_parallel_logprobs(shard, targets, parallel_state.get_tensor_model_parallel_group(), True)
    (logprobs.sum() + 0.5 * entropy.sum()).backward()
    return dict(
        packed=packed, replicated=replicated, final_norm_grad=model.decoder.final_layernorm.weight.grad,
        output_grad=model.output_layer.weight.grad, vocab_logprobs=logprobs, vocab_entropy=entropy, vocab_grad=shard.grad,
    )


def ep2():
    model = build_model("qwen3-moe-tiny", ep=2, moe_aux_loss_coeff=0.0)
    batch = make_batch()
    assert len(model.decoder.layers[0].mlp.experts.local_experts) == 4
    return dict(packed=forward_logprobs(model, batch), replicated=forward_logprobs(model, batch, layout="replicated"))


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    results = {"tp2": tp2, "ep2": ep2}[scenario]()
    torch.save(results, os.path.join(out_dir, f"rank{os.environ['RANK']}.pt"))
