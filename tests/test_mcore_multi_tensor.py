"""The optimizer's multi-tensor ops without Transformer Engine or Apex (``mcore/multi_tensor.py``):
against float64 arithmetic and ``copy_``, and through Megatron's own gradient norm and weight copy
once ``build_model`` swapped them in."""
import pytest
import torch
from megatron.core.optimizer import clip_grads, optimizer

from flash_check import DEVICE
from megatron_dualkv.mcore import use_foreach_multi_tensor_ops, use_fused_adam
from megatron_dualkv.mcore.multi_tensor import foreach_copy, foreach_l2_norm, foreach_scale
from megatron_dualkv.models import build_model

FLAG = torch.zeros(1, dtype=torch.int, device=DEVICE)


def tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(DEVICE) for shape in [(7, 5), (1,), (300,), (4, 3, 2)]]


def norm64(ts):
    return torch.cat([t.double().flatten() for t in ts]).norm().item()


def test_l2_norm_is_the_norm_of_all_elements():
    ts = tensors()
    total, per_tensor = foreach_l2_norm(2048, FLAG, [ts], True)
    assert total.shape == (1,) and total.dtype == torch.float32 and total.device.type == DEVICE
    assert total.item() == pytest.approx(norm64(ts), rel=1e-6)
    torch.testing.assert_close(per_tensor.cpu(), torch.tensor([norm64([t]) for t in ts], dtype=torch.float32))
    assert foreach_l2_norm(2048, FLAG, [ts], False)[1] is None
    assert foreach_l2_norm(2048, FLAG, [[]], False)[0].tolist() == [0.0]


def test_scale_in_place_and_into_another_dtype():
    src = tensors()
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
    for scale in (1.0, 0.25):
        foreach_scale(2048, FLAG, [src, dst], scale)
        for s, d in zip(src, dst):
            assert torch.equal(d, (s * scale).to(torch.bfloat16))
    grads = [t.clone() for t in src]
    foreach_scale(2048, FLAG, [grads, grads], 0.5)
    for s, g in zip(src, grads):
        assert torch.equal(g, s * 0.5)


def test_copy_converts_as_copy_does():
    src = tensors(seed=2)
    for dtype in (torch.bfloat16, torch.float32):
        dst = [torch.empty_like(t, dtype=dtype) for t in src]
        foreach_copy(src, dst, None)
        for s, d in zip(src, dst):
            assert torch.equal(d, torch.empty_like(d).copy_(s))
    foreach_copy([], [], None)


def test_megatron_copies_its_main_weights_in_one_foreach_call(monkeypatch):
    """Megatron's bf16 optimizer copies its fp32 main weights into the model's through the swapped
    helper: one ``_foreach_copy_`` for all parameters, not a ``copy_`` each. (The optimizer itself
    needs CUDA tensors, so its method runs on a stand-in that holds the two lists.)"""
    from types import SimpleNamespace

    build_model("qwen3-tiny")
    calls = []
    foreach = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda *a, **k: calls.append(len(a[0])) or foreach(*a, **k))
    main = tensors(seed=3)
    model = [torch.zeros_like(t, dtype=torch.bfloat16) for t in main]
    holder = SimpleNamespace(_get_model_and_main_params_data_float16=lambda: (model, main), _dummy_overflow_buf=None)
    optimizer.Float16OptimizerWithFloat16Params._copy_main_params_to_model_params(holder)
    assert calls == [len(main)]
    for m, w in zip(main, model):
        assert torch.equal(w, m.to(torch.bfloat16))


def test_megatron_runs_them_after_build_model():
    build_model("qwen3-tiny")
    if not use_foreach_multi_tensor_ops():
        pytest.skip("Transformer Engine or Apex supplies Megatron's multi-tensor ops")
    assert clip_grads.l2_norm_impl is foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is foreach_scale and optimizer.multi_tensor_scale_impl is foreach_scale
    grads = tensors(seed=1)
    norm = clip_grads.get_grad_norm_fp32(grads, grad_stats_parallel_group=torch.distributed.group.WORLD)
    assert float(norm) == pytest.approx(norm64(grads), rel=1e-6)


def adam_steps(params, steps, fuse_after=None):
    """``steps`` AdamW steps on fixed gradients, switched to the fused kernel after ``fuse_after`` steps."""
    opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01)
    for i in range(steps):
        if i == fuse_after:
            assert use_fused_adam(opt) == 1 and opt.param_groups[0]["fused"]
        for j, p in enumerate(params):
            p.grad = torch.full_like(p, 0.5 - j) + 0.01 * i
        opt.step()
    return opt


@pytest.mark.parametrize("fuse_after", [0, 2])
def test_fused_adam_takes_the_multi_tensor_steps(fuse_after):
    """The same AdamW update as the default multi-tensor one, switched before any step or after two
    (the step counts move to the device in float32, as the fused kernel reads them)."""
    reference = [t.clone().requires_grad_() for t in tensors(seed=4)]
    fused = [t.detach().clone().requires_grad_() for t in reference]
    adam_steps(reference, 4)
    opt = adam_steps(fused, 4, fuse_after)
    assert all(opt.state[p]["step"].dtype == torch.float32 and opt.state[p]["step"].device == p.device for p in fused)
    for want, got in zip(reference, fused):  # CUDA's fused kernel rounds differently: ~4e-7 after 4 steps of 0.1
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fused_adam_inside_megatron_optimizer_and_only_adam():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = build_model("qwen3-tiny", seed=5)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0), [ddp])
    groups = optimizer.param_groups
    assert use_fused_adam(optimizer) == len(groups) > 0 and all(g["fused"] and not g["foreach"] for g in groups)
    assert use_fused_adam(torch.optim.SGD(tensors(), lr=0.1)) == 0
