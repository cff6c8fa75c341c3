"""``rl.host_stash``: saved tensors in host slabs at their own sizes, the slabs kept from one use to
the next, parameters left where they are, and a backward through the stash equal to one without."""
import torch

from megatron_dualkv.rl.host_stash import ALIGN, HostStash


def test_pieces_are_aligned_and_consecutive_and_a_large_one_gets_its_own_slab():
    stash = HostStash(pin=False, slab_bytes=4096)
    a, b = stash.take(100), stash.take(3000)
    assert (a.numel(), b.numel()) == (100, 3000)
    assert (a.data_ptr(), b.data_ptr() - a.data_ptr()) == (stash.slabs[0].data_ptr(), ALIGN)
    c = stash.take(1000)  # 512 + 3072 + 1024 > 4096: the next slab
    big = stash.take(10_000)
    assert [s.numel() for s in stash.slabs] == [4096, 4096, 10_240]
    assert c.data_ptr() == stash.slabs[1].data_ptr() and big.data_ptr() == stash.slabs[2].data_ptr()


def test_the_slabs_are_kept_for_the_next_use_and_one_too_small_is_replaced():
    stash = HostStash(pin=False, slab_bytes=4096)
    with stash.hooks():
        pieces = [stash.take(n) for n in (3000, 3000)]
    reserved, first = stash.reserved_bytes, pieces[0].data_ptr()
    with stash.hooks():
        assert stash.take(3000).data_ptr() == first
        stash.take(3000)
    assert stash.reserved_bytes == reserved
    with stash.hooks():
        stash.take(8000)  # larger than the kept first slab: it is replaced
    assert [s.numel() for s in stash.slabs] == [8192, 4096]


def test_a_backward_through_the_stash_equals_one_without_and_parameters_stay():
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 24).double()
    x = torch.randn(10, 24, dtype=torch.float64, requires_grad=True)

    def grads(stash=None):
        layer.zero_grad()
        x.grad = None
        with stash.hooks() if stash is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = torch.tanh(layer(torch.sin(x))).pow(2).sum()
        loss.backward()
        return x.grad.clone(), layer.weight.grad.clone()

    expected = grads()
    stash = HostStash(pin=False, slab_bytes=1024)
    packed, real = [], stash._pack
    stash._pack = lambda t: packed.append((t, real(t))) or packed[-1][1]
    for got, want in zip(grads(stash), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    kept = [t for t, p in packed if p is t]
    assert kept and all(isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter) for t in kept)
    assert len(kept) < len(packed) and stash.reserved_bytes > 0


def test_the_stash_counts_what_it_holds_from_each_start():
    stash = HostStash(pin=False, slab_bytes=4096)
    with stash.hooks():
        stash.take(100), stash.take(3000), stash.take(5000)
    assert stash.taken_bytes == 8100 and stash.reserved_bytes == 4096 + 5120
    with stash.hooks():
        stash.take(10)
    assert stash.taken_bytes == 10


def test_selective_recompute_keeps_its_outputs_inside_the_hooks():
    """What a consumer saves is its copy in the stash: freeing the output there would save nothing
    on the GPU, and its recompute would fill a storage that no one reads."""
    from megatron_dualkv.mcore.recompute import checkpoint_without_output

    x = torch.randn(6, 8, requires_grad=True)
    linear = torch.nn.Linear(8, 3)
    with HostStash(pin=False, slab_bytes=1024).hooks():
        y, release = checkpoint_without_output(torch.tanh, x)
        release(linear(y))
    assert type(y.grad_fn).__name__ == "TanhBackward0"  # a plain call
    assert y.untyped_storage().nbytes() == y.numel() * 4
    y, release = checkpoint_without_output(torch.tanh, x)
    release(linear(y))
    assert y.untyped_storage().nbytes() == 0  # outside, the output is freed


def test_a_slab_holding_a_large_piece_still_takes_smaller_ones():
    stash = HostStash(pin=False, slab_bytes=4096)
    with stash.hooks():
        first, second, small = stash.take(3000), stash.take(3000), stash.take(500)
    assert len(stash.slabs) == 2 and small.data_ptr() == first.data_ptr() + 3072
    assert second.data_ptr() == stash.slabs[1].data_ptr()


def test_a_storage_range_saved_twice_is_copied_once_and_a_changed_one_again():
    """sin and cos both save x, and sin of a reshaped view saves its bytes again: one copy. After an
    in-place change (a new version) the same bytes are copied again, so each backward reads the
    values its forward saw."""
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    stash = HostStash(pin=False, slab_bytes=1 << 16)
    with stash.hooks():
        loss = (x.sin() + x.cos()).sum() + x.view(-1).sin().sum()
    assert stash.taken_bytes == x.numel() * 8
    loss.backward()
    x0 = x.detach()
    torch.testing.assert_close(x.grad, 2 * x0.cos() - x0.sin(), rtol=0, atol=1e-12)

    x.grad = None
    with stash.hooks():
        y = x * 1.0
        a = y.sin()
        y.mul_(2)
        b = y.sin()
        transposed = x.t().sin()  # not contiguous: a copy of its own
    assert stash.taken_bytes == 3 * x.numel() * 8
    (a.sum() + b.sum() + transposed.sum()).backward()
    torch.testing.assert_close(x.grad, 2 * x0.cos() + 2 * (2 * x0).cos(), rtol=0, atol=1e-12)
