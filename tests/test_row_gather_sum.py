"""The Triton row gather-and-sum against PyTorch ops: float64 on CPU (interpreter), and the
flash-attention style bound in low precision (the GPU in bf16 when there is one). The kernel runs
by default on CUDA only: here it is asked for (use_kernel=True)."""
import pytest
import torch

from flash_check import DEVICE, LOW, assert_within_twice_the_reference_error
from megatron_dualkv.ops.row_gather_sum import row_gather_sum, row_gather_sum_reference


def inputs(n, k, h, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(n * k, h, generator=g)).to(DEVICE, dtype)
    return x, torch.randperm(n * k, generator=g).to(DEVICE)


@pytest.mark.parametrize("n, h", [(5, 40), (3, 1100)], ids=["narrower than a block", "two blocks, the last partial"])
@pytest.mark.parametrize("k", range(1, 9))
def test_matches_float64(n, h, k):
    x, order = inputs(n, k, h, torch.float32, seed=k)
    y = row_gather_sum(x, order, k, use_kernel=True)
    want = row_gather_sum_reference(x.double(), order, k)
    assert y.shape == (n, h) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * (1 + want.abs().max().item()))


def test_low_precision_within_twice_the_pytorch_error():
    """Error against float64 at most 2x that of the same ops in PyTorch at the same precision."""
    n, k, h = (24576, 8, 2048) if DEVICE == "cuda" else (7, 8, 1100)
    x, order = inputs(n, k, h, LOW, seed=1)
    y = row_gather_sum(x, order, k, use_kernel=True)
    assert y.dtype == LOW
    assert_within_twice_the_reference_error("y", y, row_gather_sum_reference(x, order, k),
                                            row_gather_sum_reference(x.double(), order, k), 1e-3)


def test_bad_inputs_say_what_is_wrong():
    x, order = inputs(3, 2, 8, torch.float32)
    with pytest.raises(ValueError, match=r"x must be \(rows, hidden\)"):
        row_gather_sum(x.view(6, 2, 4), order, 2)
    with pytest.raises(ValueError, match="one entry per row of x"):
        row_gather_sum(x, order[:5], 2)
    with pytest.raises(ValueError, match="order must be int64"):
        row_gather_sum(x, order.int(), 2)
    for k in (0, 4):
        with pytest.raises(ValueError, match="k must be >= 1 and divide the 6 rows"):
            row_gather_sum(x, order, k)
    with pytest.raises(ValueError, match="order on meta"):
        row_gather_sum(x, order.to("meta"), 2)


def test_no_rows():
    y = row_gather_sum(torch.zeros(0, 16, device=DEVICE), torch.zeros(0, dtype=torch.int64, device=DEVICE), 4,
                       use_kernel=True)
    assert y.shape == (0, 16)


def test_the_default_runs_the_kernel_on_cuda_only(monkeypatch):
    """Off CUDA the default takes the PyTorch ops (the MoE layers' CPU runs), and use_kernel=False
    takes them everywhere."""
    from megatron_dualkv.ops import row_gather_sum as op

    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(grid)

    monkeypatch.setattr(op, "_row_gather_sum_kernel", Kernel())
    x, order = inputs(3, 2, 8, torch.float32)
    want = row_gather_sum_reference(x, order, 2)
    torch.testing.assert_close(row_gather_sum(x, order, 2, use_kernel=False), want, rtol=0, atol=0)
    default = row_gather_sum(x, order, 2)
    assert len(launches) == (1 if x.is_cuda else 0)
    if not x.is_cuda:
        torch.testing.assert_close(default, want, rtol=0, atol=0)
