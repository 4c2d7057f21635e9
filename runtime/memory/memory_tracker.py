"""Allocated-bytes peak of a CPU rank: what `torch.cuda.max_memory_allocated` reports on a GPU.

Why: the memory model predicts the bytes of live tensors (parameters, gradients, optimizer state,
activations, K/V buffers), as CUDA's allocator counts them on a GPU. The resident set of a CPU
process is another quantity: it adds the torch/gloo baseline, glibc's free lists and pages
touched once, so it cannot check the model. CPU torch keeps no allocated-bytes statistics, so a
rank counts them itself: a TorchDispatchMode sees every tensor an op returns (forward,
autograd's backward and the collectives' buffers alike), registers its storage once and drops
it when the storage dies (a weakref finalizer: torch keeps one Python object per storage alive
as long as the storage is). Tensors alive when tracking starts (the model, optimizer state) are
found once through the garbage collector. Bytes are storage bytes, as CUDA's allocator counts a
block (less its 512-byte rounding).

What it misses: memory a kernel allocates inside itself without returning it as a tensor
(scratch of a CPU GEMM, gloo's staging buffers) - on a GPU, NCCL's buffers are outside
max_memory_allocated too.

Cost: ~30 us per op in Python (measured: an add of 64 x 64 floats 4.7 us bare, 32 us tracked),
so it tracks only the first `STEPS` optimizer steps of a job: step 0 (warm-up) and step 1,
the first with optimizer state alive all through (the steady state every later step repeats).
`csbp validate` warms up for two steps, so its timed steps run untracked.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

STEPS = 2  # optimizer steps tracked per job (see the module docstring)


class AllocatedBytes(TorchDispatchMode):
    """Live CPU tensor-storage bytes now and their maximum since `start`."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def add(self, t: object) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_meta:
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        n = storage.nbytes()
        if not isinstance(n, int):  # a fake tensor being traced (symbolic size): no memory held
            return
        self.live[key] = n
        self.now += n
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self.add(t)
        return out


_tracker: AllocatedBytes | None = None
_hook = None
_steps = 0


def start() -> None:
    """Track from now (a job's start): what is alive now, then every op's outputs, until
    `STEPS` optimizer steps have run. Restarts a tracker already running."""
    global _tracker, _hook, _steps
    stop()
    _tracker, _steps = AllocatedBytes(), 0
    gc.collect()
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # type(): no module proxy's __class__ lookup
            _tracker.add(obj)
    _tracker.__enter__()
    _hook = register_optimizer_step_post_hook(_after_step)


def _after_step(optimizer, args, kwargs) -> None:
    global _steps
    _steps += 1
    if _steps >= STEPS:
        stop()


def stop() -> None:
    """Stop tracking; the peak so far stays readable."""
    global _hook
    if _hook is not None:
        _hook.remove()
        _hook = None
        _tracker.__exit__(None, None, None)


def peak_bytes() -> int | None:
    """The largest live tensor bytes seen since `start`, None when nothing was tracked."""
    return None if _tracker is None else _tracker.peak
