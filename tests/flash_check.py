"""The flash-attention style accuracy check of the GPU kernel tests: every output and gradient
within 2x the error of the same-precision PyTorch reference (plus a small epsilon), both measured
against the float64 reference."""
import torch

from megatron_dualkv import dualkv_attn_func


def grads(layout, q, k, v, dout, backend, **kw):
    x = [t.detach().requires_grad_() for t in (q, k, v)]
    out = dualkv_attn_func(*x, layout, backend=backend, **kw)
    return (out, *torch.autograd.grad(out, x, dout))


def check_flash_style(layout, hq, hkv, d, dtype, seed=0, backend="triton", eps=1e-4, **kw):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = layout.total_tokens
    q, k, v = (torch.randn(T, h, d, device="cuda", dtype=dtype, generator=g) for h in (hq, hkv, hkv))
    dout = torch.randn(T, hq, d, device="cuda", dtype=dtype, generator=g)
    ours = grads(layout, q, k, v, dout, backend, **kw)
    ref_lp = grads(layout, q, k, v, dout, "reference", **kw)
    ref64 = grads(layout, *(t.double() for t in (q, k, v, dout)), "reference", **kw)
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), ours, ref_lp, ref64):
        assert torch.isfinite(a).all(), name
        err, ref_err = (a.double() - r).abs().max().item(), (b.double() - r).abs().max().item()
        assert err <= 2 * ref_err + eps * (1 + r.abs().max().item()), f"{name}: {err:.3e} vs reference {ref_err:.3e}"
