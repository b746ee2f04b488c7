"""Fake ranks: rank N of a world under torch's ``fake`` process group (no communication), so that
``plan`` (and tests) can build and lay out every rank's model in one process."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


def register_fake_backend() -> None:
    """torch's ``fake`` process group backend (registered by importing its module)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401


def clear_sharding_caches() -> None:
    """Forget DTensor's sharding-propagation caches.

    They key device meshes by value, so after a fake rank's group is gone the next rank's DTensors
    would come back carrying the previous rank's mesh object, hence its coordinate.
    """
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


@contextmanager
def fake_rank(rank: int, world: int) -> Iterator[None]:
    """Rank ``rank`` of ``world`` under torch's ``fake`` process group (no communication)."""
    import torch.distributed as dist

    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        clear_sharding_caches()
