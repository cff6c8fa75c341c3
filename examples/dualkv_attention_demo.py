"""Pack a few GRPO-style rollout groups, run DualKV attention on the packed layout and plain
causal attention on the replicated layout, and print the savings and the largest difference.

    python examples/dualkv_attention_demo.py [--groups 3 --responses 8 --prompt 96 --response 24]
"""
import argparse
import random

import torch

from megatron_dualkv import RolloutGroup, dualkv_attn_func, pack_groups


def make_groups(args, rng):
    groups = []
    for _ in range(args.groups):
        prompt = [rng.randrange(args.vocab) for _ in range(rng.randint(args.prompt // 2, args.prompt))]
        responses = [
            [rng.randrange(args.vocab) for _ in range(rng.randint(1, args.response))] for _ in range(args.responses)
        ]
        groups.append(RolloutGroup(prompt, responses))
    return groups


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--responses", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=96, help="longest prompt")
    parser.add_argument("--response", type=int, default=24, help="longest response")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "reference"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float64
    batch = pack_groups(make_groups(args, rng), pad_to_multiple_of=8).to(device)
    rep = batch.replicated()

    T = batch.num_tokens
    q = torch.randn(T, args.heads, args.head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(T, args.kv_heads, args.head_dim, device=device, dtype=dtype) for _ in range(2))
    packed = dualkv_attn_func(q, k, v, batch.layout, backend=args.backend)
    # baseline: every response with its own prompt copy, causal attention per sequence
    replicated = dualkv_attn_func(q[rep.index], k[rep.index], v[rep.index], rep.layout, backend=args.backend)
    diff = (packed[rep.index] - replicated).abs().max().item()

    print(f"groups={args.groups} responses/group={args.responses} device={device} dtype={dtype}")
    print(f"tokens: replicated {rep.tokens.numel()}  packed {T - batch.layout.pad_len} (+{batch.layout.pad_len} pad)")
    print(f"token reduction rho          = {batch.rho:.2f}x")
    print(f"attention-pair reduction     = {batch.attention_pair_ratio:.2f}x")
    print(f"max |packed - replicated|    = {diff:.3e}")
    if diff > (1e-9 if dtype == torch.float64 else 2e-2):
        raise SystemExit("packed and replicated attention disagree")


if __name__ == "__main__":
    main()
