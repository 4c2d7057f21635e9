"""The CPU runtime's allocated-bytes counter: storages counted once, freed when they die, the
peak kept, tensors alive at the start included, and tracking ending after the tracked steps."""

import torch

from csbp.runtime.memory import memory_tracker

MIB = 2**20


def test_storages_count_once_and_free_when_they_die():
    tracker = memory_tracker.AllocatedBytes()
    with tracker:
        a = torch.zeros(MIB // 4)  # 1 MiB of fp32
        view = a[10:].view(-1, 2)  # no new storage
        assert tracker.now == MIB
        b = a * 2  # a second MiB
        assert tracker.now == 2 * MIB
        del a
        assert tracker.now == 2 * MIB  # the view keeps a's storage alive
        del view
        assert tracker.now == MIB
        b.add_(1)  # in place: nothing new
        del b
    assert tracker.now == 0 and tracker.peak == 2 * MIB


def test_autograd_saved_tensors_and_gradients_are_counted():
    tracker = memory_tracker.AllocatedBytes()
    x = torch.ones(MIB // 4, requires_grad=True)
    tracker.add(x)
    with tracker:
        y = x.exp()  # saved by exp for backward
        assert tracker.now == 2 * MIB
        y.sum().backward()
    assert x.grad is not None and tracker.now >= 2 * MIB  # x and its gradient
    assert tracker.peak >= 3 * MIB  # x, the saved exp, and the gradient's product


def test_start_counts_live_tensors_and_stops_after_the_tracked_steps():
    keep = torch.zeros(MIB // 4)
    param = torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.SGD([param], lr=0.1)
    memory_tracker.start()
    try:
        assert memory_tracker.peak_bytes() >= MIB  # `keep` was alive at the start
        for _ in range(memory_tracker.STEPS):
            param.grad = torch.ones(8)
            opt.step()
        before = memory_tracker.peak_bytes()
        big = torch.zeros(16 * MIB // 4)  # after the tracked steps: not counted
        assert memory_tracker.peak_bytes() == before
        del big
    finally:
        memory_tracker.stop()
    del keep
