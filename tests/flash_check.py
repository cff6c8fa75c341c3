"""The flash-attention style accuracy check of the kernel tests: every output and gradient
within 2x the error of the same-precision PyTorch reference (plus a small epsilon), both measured
against the float64 reference."""
import torch

from megatron_dualkv import dualkv_attn_func

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter has no working bf16


def assert_within_twice_the_reference_error(name, ours, reference, exact, eps):
    """``ours``' error against ``exact`` (float64) at most 2x the same-precision ``reference``'s,
    plus ``eps`` relative to the size of ``exact``."""
    err, ref_err = (ours.double() - exact).abs().max().item(), (reference.double() - exact).abs().max().item()
    assert err <= 2 * ref_err + eps * (1 + exact.abs().max().item()), f"{name}: {err:.3e} vs reference {ref_err:.3e}"


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
        assert_within_twice_the_reference_error(name, a, b, r, eps)
