"""Process groups and device meshes the package makes, made once per process and reused.

A process group holds its threads and sockets (gloo: a few threads per group and rank) until the
default group is destroyed; torch releases none earlier. Made afresh per call, as transformers'
``prepare_distribute_model`` makes its two 4-D meshes, every ``from_pretrained`` added 18 threads
per rank on 2 ranks, without end. Here each is made on its first use and the same object is
returned for every later use with the same key (sizes, dim names, backend) under the same default
group; after ``destroy_process_group`` and a new ``init_process_group``, they are made again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")

_lock = threading.Lock()
_world: Any = None
"""The default group the entries of :data:`_made` were made under (held, so no later one is it)."""
_made: dict[Hashable, Any] = {}


def reused(key: Hashable, make: Callable[[], T]) -> T:
    """``make()`` on the first call with ``key`` under the current default group, its result after.

    Making a group is collective: every rank calls this with the same keys in the same order, as it
    would call ``make`` itself."""
    with _lock:
        _follow_world()
        if key not in _made:
            made = make()
            _follow_world()  # ``make`` may have set up the default group (transformers' meshes do)
            _made[key] = made
        return _made[key]


def _follow_world() -> None:
    """Forget what was made under a default group that is no longer the current one."""
    global _world
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if world is not _world:
        _made.clear()
        _world = world


def gloo_group() -> Any:
    """A gloo group of every rank, for bytes that travel as CPU tensors: the default group when it
    runs gloo, else (NCCL moves CUDA tensors only) one made for all such uses of the process."""
    if "gloo" in str(dist.get_backend()):
        return dist.group.WORLD
    return reused("gloo", lambda: dist.new_group(backend="gloo"))
