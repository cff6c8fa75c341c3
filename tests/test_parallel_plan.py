"""The parallel layout (megatron_dualkv.mcore.parallel), the context-parallel helpers and the
sequence-parallel norm, in one process; test_parallel runs them on several ranks."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dualkv.mcore import DualKVAttention, DualKVPackedSeqParams, ParallelSizes, parallel, plan_parallel
from megatron_dualkv.mcore.context_parallel import context_parallel_params, context_parallel_slice, kv_head_replication
from megatron_dualkv.mcore.norms import FusedRMSNorm, SequenceParallelTorchNorm
from megatron_dualkv.models import build_model
from rollouts import make_batch


class FakeGroup(SimpleNamespace):
    def size(self):
        return self.world

    def rank(self):
        return self.me


def test_plan_splits_the_world():
    plan = plan_parallel(16, tp=2, pp=2, cp=2, ep=2)
    assert (plan.dp, plan.expert_dp, plan.world_size) == (2, 2, 16)
    assert plan.sizes == ParallelSizes(tp=2, pp=2, cp=2, ep=2, etp=2, sp=True)
    assert plan_parallel(8, tp=2, ep=8, etp=1).expert_dp == 1
    assert plan_parallel(1).dp == 1 and not plan_parallel(1).sizes.sp


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((3,), dict(tp=2), r"tp\*pp\*cp = 2 ranks per model replica, but this world has 3 process"),
        ((4,), dict(tp=2, pp=2, ep=2), r"dp\*tp\*cp = 2 ranks of a pipeline stage cannot hold experts split ep\*etp = 4 ways"),
        ((4,), dict(vpp=2), "needs pp > 1"),
        ((2,), dict(sp=True), "needs tp > 1"),
        ((2,), dict(cp=0), "cp must be a positive int"),
        ((2,), dict(tp=True), "tp must be a positive int"),
        ((0,), {}, "world_size must be a positive int"),
    ],
)
def test_plan_refuses_what_does_not_split(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_parallel(*args, **kwargs)


@pytest.mark.parametrize(
    "sizes, multiple",
    [(ParallelSizes(), 1), (ParallelSizes(tp=2), 2), (ParallelSizes(tp=2, sp=False), 1), (ParallelSizes(cp=4), 4),
     (ParallelSizes(tp=2, cp=2), 4), (ParallelSizes(tp=4, pp=2, ep=8), 4)],
)
def test_token_multiple(sizes, multiple):
    assert sizes.token_multiple == multiple


def test_megatrons_own_context_parallelism_stays_off():
    kwargs = ParallelSizes(tp=2, pp=2, cp=2, vpp=2).transformer_config_kwargs()
    assert kwargs["context_parallel_size"] == 1 and kwargs["sequence_parallel"]
    assert not kwargs["variable_seq_lengths"] and not kwargs["batch_p2p_comm"]
    assert ParallelSizes(pp=2).transformer_config_kwargs()["variable_seq_lengths"]


@pytest.mark.parametrize(
    "heads, kv_heads, cp, replicas",
    [(4, 2, 2, 1), (8, 8, 4, 1), (4, 1, 2, 2), (8, 2, 8, 4), (6, 3, 2, 2), (12, 4, 6, 3)],
)
def test_kv_heads_are_replicated_to_whole_heads_per_rank(heads, kv_heads, cp, replicas):
    assert kv_head_replication(heads, kv_heads, cp) == replicas
    expanded = kv_heads * replicas
    assert expanded % cp == 0
    for h in range(heads):  # query head h reads a copy of its own KV head on its own rank
        rank, copy = h // (heads // cp), h // (heads // expanded)
        assert copy // replicas == h // (heads // kv_heads)
        assert copy // (expanded // cp) == rank


def test_query_heads_must_split_over_context_parallel_ranks():
    with pytest.raises(ValueError, match=r"cp=4 ranks, but this rank has 2 query heads; num_attention_heads must be a multiple of tp\*cp"):
        kv_head_replication(2, 1, 4)


def test_context_parallel_slices():
    assert context_parallel_slice(40, None) == slice(0, 40)
    assert context_parallel_slice(40, FakeGroup(world=4, me=2)) == slice(20, 30)
    with pytest.raises(ValueError, match="into 4 equal slices, but it has 38 tokens; pack with"):
        context_parallel_slice(38, FakeGroup(world=4, me=0))


def test_context_parallel_params_cut_the_segments_to_the_rank():
    batch = make_batch()  # 40 tokens
    params = DualKVPackedSeqParams.from_layout(batch.layout)
    group = FakeGroup(world=4, me=1)
    local = context_parallel_params(params, group)
    bounds = [b for b in batch.layout.cu_seqlens.tolist() if 10 < b < 20]
    assert local.cu_seqlens_q.tolist() == [0, *[b - 10 for b in bounds], 10]
    assert local.cp_group is group and local.layout is batch.layout and params.cp_group is None


def test_sequence_parallel_norm_marks_its_parameters():
    base = dict(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm")
    sp = TransformerConfig(**base, tensor_model_parallel_size=2, sequence_parallel=True)
    norm = SequenceParallelTorchNorm(sp, 8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-6
    assert norm.weight.sequence_parallel and sp.sequence_parallel, "the model's config keeps sequence_parallel"
    assert SequenceParallelTorchNorm(TransformerConfig(**base), 8).weight.sequence_parallel is False


def test_rms_norm_is_the_fused_one_and_layer_norm_stays_torchs():
    base = dict(num_layers=1, hidden_size=8, num_attention_heads=2)
    rms = SequenceParallelTorchNorm(TransformerConfig(**base, normalization="RMSNorm"), 8, eps=1e-6)
    assert type(rms) is FusedRMSNorm
    assert type(SequenceParallelTorchNorm(TransformerConfig(**base, normalization="LayerNorm"), 8)) is torch.nn.LayerNorm


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused (compiled) path runs on CUDA")
def test_fused_rms_norm_matches_torch_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(333, 2, 4096, device="cuda", generator=g).bfloat16()
    dout = torch.randn_like(x)
    fused = FusedRMSNorm(4096, eps=1e-6).cuda().bfloat16()
    with torch.no_grad():
        fused.weight.copy_(1 + 0.1 * torch.randn(4096, device="cuda", generator=g))
    exact = torch.nn.RMSNorm(4096, eps=1e-6).cuda().double()
    exact.load_state_dict(fused.state_dict())
    results = []
    for norm, inp in ((fused, x), (exact, x.double())):
        inp = inp.clone().requires_grad_()
        out = norm(inp)
        results.append((out, *torch.autograd.grad(out, (inp, norm.weight), dout.to(inp.dtype))))
    for name, a, b in zip(("out", "dx", "dweight"), *results):
        torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=2e-2 * b.abs().max().item(), msg=name)
    # forward-only passes and selective recompute's forwards run without autograd: fused there too
    with torch.no_grad():
        torch.testing.assert_close(fused(x).double(), results[1][0], rtol=2e-2, atol=2e-2 * results[1][0].abs().max().item())
        # as the local spec builds it: a float32 weight beside bf16 activations, where torch's own
        # forward cannot take its fused kernel (PERF_NOTES.md, run DU)
        mixed = FusedRMSNorm(4096, eps=1e-6).cuda()
        assert cuda_kernels(lambda: mixed(x)) < cuda_kernels(lambda: torch.nn.RMSNorm.forward(mixed, x))


def cuda_kernels(run) -> int:
    """CUDA kernels one call of ``run`` launches (after a first call: compiling launches its own)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def test_attention_refuses_megatrons_context_parallelism():
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, kv_channels=16,
                            attention_dropout=0.0, activation_func=F.silu, context_parallel_size=2)
    with pytest.raises(ValueError, match="keep context_parallel_size=1"):
        DualKVAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=SimpleNamespace(tp=FakeGroup(world=1, me=0)))


@pytest.mark.parametrize(
    "card, kwargs, message",
    [
        ("qwen3-tiny", dict(cp=3), r"num_attention_heads \(4\) is not divisible by tp\*cp \(3\)"),
        ("qwen3-tiny", dict(tp=2, cp=4), r"num_attention_heads \(4\) is not divisible by tp\*cp \(8\)"),
        ("qwen3-tiny", dict(pp=2, vpp=2), r"num_layers \(2\) is fewer than the pp\*vpp \(4\) pipeline stages"),
        ("qwen3-moe-tiny", dict(tp=2, sp=False), "MoE layers train under tensor parallelism only with sequence parallelism"),
    ],
)
def test_build_model_refuses_a_split_the_model_does_not_allow(card, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_model(card, **kwargs)


def test_more_ranks_per_node_than_gpus_is_refused_before_nccl(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("set_device reached"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(RuntimeError, match="LOCAL_RANK=1 needs GPU 1, but this machine shows 1"):
        parallel._init_process_group()
