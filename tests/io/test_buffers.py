"""The build's pool of reused buffers (moemerge/buffers.py): a buffer comes back only once no
view of it is left, the pool never holds more than its capacity, and builds give the same
bytes with and without it."""

import torch

from moemerge import buffers
from moemerge.buffers import GRAIN, SMALLEST, BufferPool

MiB = 1 << 20


def _address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_buffer_is_reused_once_no_view_of_it_is_left():
    pool = BufferPool(64 * MiB)
    a = pool.empty((1024, 1024), torch.bfloat16)  # 2 MiB
    where = _address(a)
    row = a[3]  # a view keeps the buffer busy after `a` is gone
    del a
    b = pool.empty((1024, 1024), torch.bfloat16)
    assert _address(b) != where  # busy: another buffer
    del row
    c = pool.empty((512, 2048), torch.bfloat16)  # the same size, another shape
    assert _address(c) == where and c.shape == (512, 2048) and c.dtype == torch.bfloat16
    assert (pool.made, pool.reused) == (2, 1)
    c.fill_(1.5)  # a working tensor: written and read through its own shape
    assert c.sum().item() == 1.5 * 512 * 2048


def test_sizes_round_up_to_the_grain_and_small_tensors_are_not_pooled():
    pool = BufferPool(64 * MiB)
    t = pool.empty((GRAIN // 4 + 1,), torch.float32)  # just over one grain
    assert t.untyped_storage().nbytes() == 2 * GRAIN
    small = pool.empty((SMALLEST // 4 - 1,), torch.float32)
    assert pool.made == 1 and small.untyped_storage().nbytes() < SMALLEST


def test_the_pool_holds_at_most_its_capacity():
    pool = BufferPool(8 * MiB)
    held = [pool.empty((MiB,), torch.float32) for _ in range(3)]  # 4 MiB each: the third spills
    assert pool.held_bytes() == 8 * MiB and pool.made == 2
    assert held[2].untyped_storage().nbytes() == 4 * MiB  # a plain tensor, outside the pool
    del held
    # free buffers of another size make room, least recently used first
    other = pool.empty((3 * MiB // 4,), torch.float32)  # 4 MiB rounds to 4 MiB: reused
    assert pool.reused == 1
    # 6 MiB: the free buffer goes, and 4 MiB held by `other` + 6 would still pass 8: plain
    bigger = pool.empty((6 * MiB // 4,), torch.float32)
    assert pool.held_bytes() == 4 * MiB and pool.made == 2
    del other
    again = pool.empty((6 * MiB // 4,), torch.float32)  # now `other`'s buffer makes room
    assert pool.held_bytes() == 6 * MiB and pool.made == 3
    del bigger, again


def test_empty_uses_the_active_pool_only_inside_pooled():
    assert buffers.empty((MiB,), torch.float32).untyped_storage().nbytes() == 4 * MiB
    with buffers.pooled(16 * MiB) as pool:
        buffers.empty((MiB,), torch.float32)
        assert pool.made == 1
    assert buffers._active is None
