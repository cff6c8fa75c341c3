"""``mcore.offload``: offloaded layers' saved tensors leave the device at the layer's end and come back
for the backward, which equals the one that kept them (CPU: the host copies are plain copies; the
streams and page-locked pieces run in ``tests/test_offload_gpu.py``)."""
import weakref

import pytest
import torch

from megatron_dualkv.mcore import offload
from megatron_dualkv.mcore.offload import LayerOffload, prefetch_distance
from megatron_dualkv.mcore.recompute import checkpoint_without_output, recompute_config_kwargs
from megatron_dualkv.memory import GIB, MemoryModel
from megatron_dualkv.models import build_model
from megatron_dualkv.rl.host_stash import HostStash
from megatron_dualkv.rl.prefix_reuse import check_prefix_reuse_supported
from test_recompute import _load_balanced, check_same_step

CPU = torch.device("cpu")


@pytest.fixture
def everything_offloaded(monkeypatch):
    """A fresh offload, with small slabs."""
    fresh = LayerOffload(HostStash(pin=False, slab_bytes=1 << 16))
    monkeypatch.setattr(offload, "layer_offload", lambda: fresh)
    return fresh


def _layers(offloader, x, offloaded, distance=1, release=False):
    """Four toy layers (positions 1-4); each keeps a weak reference to the tensor its sin saves."""
    refs, groups = [], []
    for position in range(1, 5):
        with offloader.layer(position, position in offloaded, CPU, distance) as mark_output:
            h = x * (position + 1.0)
            if release:  # a consumer saves h's storage, then selective recompute frees it
                h, release_h = checkpoint_without_output(lambda t, s=position + 1.0: t * s, x)
            x = h.sin() + x
            if release:
                release_h(x)
            refs.append(weakref.ref(h))
            del h
        mark_output(x)
        groups.append(offloader._chain.offloaded[-1] if position in offloaded else None)
    return x, refs, groups


@pytest.mark.parametrize("release", [False, True], ids=["kept", "released"])
def test_offloaded_layers_free_what_they_saved_and_give_the_same_gradient(everything_offloaded, release):
    x0 = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    _layers(LayerOffload(HostStash(pin=False)), x0, set(), release=release)[0].sum().backward()
    want, x0.grad = x0.grad, None
    out, refs, _ = _layers(everything_offloaded, x0, {1, 2}, release=release)
    # offloaded and kept on the host: gone from the device; released: kept (its recompute restores it)
    assert [ref() is None for ref in refs] == [not release, not release, False, False]
    out.sum().backward()
    torch.testing.assert_close(x0.grad, want, rtol=0, atol=0)


def test_layer_2s_copy_back_starts_at_layer_3_with_distance_1(everything_offloaded):
    x0 = torch.randn(4, 3, requires_grad=True)
    offloader = everything_offloaded
    marks = {}
    x = x0
    for position in range(1, 5):
        with offloader.layer(position, position <= 2, CPU, 1) as mark_output:
            x = (x * 2).sin() + x
        mark_output(x)
        marks[position] = x
    groups = offloader._chain.offloaded
    state = {}
    def note(grad, position):
        state[position] = [group.fetched for group in groups]

    for position, t in marks.items():
        t.register_hook(lambda grad, position=position: note(grad, position))
    x.sum().backward()
    # what each layer's output gradient finds fetched, after the offload's own hook (registered first)
    assert state == {4: [False, False], 3: [False, True], 2: [True, True], 1: [True, True]}


def test_views_of_one_storage_share_one_host_copy_and_come_back_as_views(everything_offloaded):
    x0 = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)

    def layer(x):
        qk = x * 3.0
        q, k = qk[:, :3], qk.t()[3:]  # two strided views of one storage, both saved
        return (q * q).sum() + k.sin().sum()

    want = torch.autograd.grad(layer(x0), x0)[0]
    offloader = everything_offloaded
    with offloader.layer(1, True, CPU, 1) as mark_output:
        y = layer(x0)
    mark_output(y)
    group = offloader._chain.offloaded[0]
    assert len(group.copied) == 1
    torch.testing.assert_close(torch.autograd.grad(y, x0)[0], want, rtol=0, atol=0)
    assert group.copied[0].restored is None  # dropped after its last unpack


def test_a_retained_graph_backpropagates_twice(everything_offloaded):
    x0 = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    out, _, _ = _layers(everything_offloaded, x0, {1, 2, 3})
    first = torch.autograd.grad(out.sum(), x0, retain_graph=True)[0]
    second = torch.autograd.grad(out.sum(), x0)[0]
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_the_next_step_starts_over_at_the_first_slab(everything_offloaded):
    x0 = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    addresses, outputs = [], []
    for _ in range(2):
        out, _, groups = _layers(everything_offloaded, x0, {1, 2})
        addresses.append([r.host.data_ptr() for g in groups if g for r in g.copied])
        out.sum().backward()
        outputs.append(out)  # its graph stays alive, its backward done
    assert addresses[0] == addresses[1]
    assert everything_offloaded.stash.reserved_bytes == 1 << 16


def test_parameters_stay_where_they_are(everything_offloaded):
    weight = torch.nn.Parameter(torch.randn(4, 4))
    x0 = torch.randn(3, 4, requires_grad=True)
    with everything_offloaded.layer(1, True, CPU, 1) as mark_output:
        y = torch.nn.functional.linear(x0, weight).tanh()
    mark_output(y)
    assert everything_offloaded.stash.taken_bytes == x0.nbytes + y.nbytes  # the input and tanh's output
    y.sum().backward()
    assert weight.grad is not None


def test_prefetch_distance_grows_with_the_offloaded_layers():
    assert [prefetch_distance(n) for n in (1, 2, 3, 5, 10)] == [1, 1, 2, 2, 4]


def test_recompute_config_kwargs_of_offload():
    assert recompute_config_kwargs("offload", 3) == dict(
        recompute_granularity="selective", recompute_modules=[], recompute_norms=True, recompute_qk_norm_rope=True,
        recompute_activations=True, offload_layers=3)
    with pytest.raises(ValueError, match="recompute='offload' needs recompute_layers"):
        recompute_config_kwargs("offload")


@pytest.mark.skipif(torch.cuda.is_available(), reason="float32 on CPU, as tests/test_recompute.py; GPU: test_offload_gpu.py")
@pytest.mark.parametrize("card", ["qwen3-tiny", "qwen3-moe-tiny", "gemma4-tiny", "qwen3_5-tiny"])
def test_offloaded_layers_give_the_step_without_recompute(everything_offloaded, card):
    # the tiny models' tensors are far below the size worth a copy on a GPU: offload them all
    model = check_same_step(card, _load_balanced(card, None), recompute="offload", recompute_layers=2,
                            offload_min_bytes=0)
    assert model.config.offload_layers == 2 and model.config.recompute_norms
    assert everything_offloaded.stash.taken_bytes > 0


def test_prefix_reuse_and_fp8_refuse_offloaded_layers():
    model = build_model("qwen3-tiny", recompute="offload", recompute_layers=1)
    with pytest.raises(ValueError, match="prefix reuse .* does not support offloaded layers"):
        check_prefix_reuse_supported(model, "packed")
    with pytest.raises(ValueError, match="recompute='offload' does not run under FP8"):
        build_model("qwen3-tiny", recompute="offload", recompute_layers=1, fp8="e4m3")
    with pytest.raises(ValueError, match="recompute='offload' does not run under FP8"):
        build_model("qwen3-tiny", fp8="e4m3", **recompute_config_kwargs("selective"), offload_layers=1)


@pytest.mark.parametrize("fp8", [False, True])
def test_the_memory_model_offloads_on_the_transformer_engine_spec_in_bf16_only(fp8):
    """The TE spec keeps plain tensors in bf16, which offload as the local spec's do
    (tests/test_transformer_engine_gpu.py runs it); under FP8 the ladder recomputes instead."""
    te = MemoryModel.for_card("qwen3-4b", transformer_engine=True, fp8=fp8)
    fit = te.fit(128 * GIB, 24576, 16384 / 24576, host_budget_bytes=64 * GIB)
    assert (fit.recompute == "offload") == (not fp8) and fit.recompute_layers
    if fp8:  # asked for by name, the setting build_model refuses is refused here too
        with pytest.raises(ValueError, match="recompute='offload' does not run under FP8"):
            te.predict(24576, recompute="offload", recompute_layers=1)
        with pytest.raises(ValueError, match="recompute='offload' does not run under FP8"):
            te.fit(128 * GIB, 24576, recompute="offload", recompute_layers=1)
