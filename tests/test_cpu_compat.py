"""megatron_dualkv.mcore.cpu_compat: what it maps, that it is explicit, reversible and inert with CUDA."""
import pytest
import torch
from megatron.core import tensor_parallel

from megatron_dualkv.mcore import ParallelSizes, cpu_compat, initialize_parallel_state

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the mappings only exist without CUDA")


@pytest.fixture
def compat():
    was_enabled = cpu_compat.cpu_compat_enabled()
    cpu_compat.enable_cpu_compat()
    yield
    if not was_enabled:
        cpu_compat.disable_cpu_compat()


def test_cuda_tensors_land_on_the_cpu(compat):
    assert torch.cuda.current_device() == torch.device("cpu")
    for device in ("cuda", "cuda:0", 0, torch.device("cuda")):
        assert torch.zeros(2, device=device).device.type == "cpu"
    x = torch.ones(3)
    assert x.to("cuda").device.type == "cpu"
    assert x.to(device=torch.cuda.current_device(), dtype=torch.float64).dtype == torch.float64
    assert x.cuda() is x
    assert torch.tensor([1, 2], pin_memory=True).tolist() == [1, 2]
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    stream.record_event().synchronize()


def test_rng_tracker_forks_the_cpu_generator(compat):
    initialize_parallel_state(ParallelSizes(), seed=7)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tensor_parallel.get_cuda_rng_tracker().fork():
        forked = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before), "fork must restore the default generator"
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        again = torch.rand(4)
    assert torch.equal(forked, again), "the tracker's stream must come from the seed"
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    default_stream = torch.rand(4)
    tensor_parallel.model_parallel_cuda_manual_seed(8)
    assert not torch.equal(default_stream, torch.rand(4)), "model_parallel_cuda_manual_seed must seed the generator"


def test_split_sizes_become_host_values(compat):
    from megatron.core.transformer.moe import token_dispatcher

    sizes = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert list(sizes) == [3, 1] and not torch.is_tensor(sizes)


def test_disable_restores_everything(compat):
    from megatron.core.transformer.moe import moe_utils

    originals = list(cpu_compat._patches)
    assert originals
    cpu_compat.disable_cpu_compat()
    try:
        assert not cpu_compat.cpu_compat_enabled()
        with pytest.raises((AssertionError, RuntimeError)):
            torch.zeros(1, device="cuda")
        with pytest.raises(AssertionError):
            torch.cuda.current_device()
        # what Megatron defined comes back, what it did not define is gone again
        # (moe_utils.te_general_gemm: absent without TE up to 0.16, None in later versions)
        for owner, name, original in originals:
            assert getattr(owner, name, cpu_compat._MISSING) is original, name
    finally:
        assert cpu_compat.enable_cpu_compat()
    assert cpu_compat.enable_cpu_compat(), "enabling twice is a no-op that reports the mappings active"
    assert moe_utils.te_general_gemm is None


def test_inert_when_cuda_is_available(monkeypatch):
    was_enabled = cpu_compat.cpu_compat_enabled()
    cpu_compat.disable_cpu_compat()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        assert cpu_compat.enable_cpu_compat() is False
        assert not cpu_compat.cpu_compat_enabled()
    finally:
        monkeypatch.undo()
        if was_enabled:
            cpu_compat.enable_cpu_compat()


def test_importing_the_package_maps_nothing():
    import subprocess
    import sys

    code = (
        "import torch, megatron_dualkv, megatron_dualkv.mcore, megatron_dualkv.models, megatron_dualkv.rl;"
        "from megatron_dualkv.mcore import cpu_compat;"
        "assert not cpu_compat.cpu_compat_enabled();"
        "import torch.cuda; torch.cuda.current_device()"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "Torch not compiled with CUDA enabled" in result.stderr, result.stderr[-2000:]
