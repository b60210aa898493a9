"""The data loaders `Accelerator.prepare` returns: each rank's share of the batches, on the device.

Rank r of N gets the original loader's batches r, r+N, r+2N, ... (Accelerate without
split_batches): the global batch of step k is the original batches kN .. kN+N-1. A last round
with fewer than N full batches is completed from the epoch's first samples, so every rank gets
the same number of full batches (Accelerate's even_batches); `gather_for_metrics` drops those
repeats again. With the loader's drop_last, an incomplete last round is dropped instead.

A shuffling RandomSampler draws its order from a generator seeded with seed + epoch, where the
seed comes from rank 0 once (so every rank draws the same order; Accelerate synchronises rank 0's
generator at each epoch instead). The epoch advances when an iteration runs to its end, or by
`set_epoch(e)`, and is saved by `Accelerator.save_state`, so a resumed run replays the same order
(`Accelerator.skip_first_batches` then skips what was done). Other samplers are used as they are
and must give every rank the same order. A loader whose sampler is already a DistributedSampler
is only moved to the device. An iterable dataset is read by every rank, each keeping every N-th
batch; its last incomplete round is dropped.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler

__all__ = ["PreparedDataLoader", "SkipBatches", "move_to_device", "shard_rounds"]

_COPIED = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
           "multiprocessing_context", "persistent_workers")


def shard_rounds(batches, world: int, rank: int, batch_size: int | None, drop_last: bool):
    """Rank `rank`'s batches of index lists: one per round of `world` original batches, the last
    round completed from the first indices unless `drop_last` (or the batch size is unknown)."""
    first: list[int] = []
    pending: list[list[int]] = []
    need_first = world * (batch_size or 0)
    for batch in batches:
        batch = list(batch)
        if len(first) < need_first:
            first.extend(batch[:need_first - len(first)])
        pending.append(batch)
        if len(pending) == world:
            if batch_size is None or all(len(b) == batch_size for b in pending):
                yield pending[rank]
                pending = []
    if not pending or drop_last or batch_size is None:
        return
    flat = [i for b in pending for i in b]
    while len(flat) < world * batch_size:
        flat.extend(first[:world * batch_size - len(flat)])
    yield flat[rank * batch_size:(rank + 1) * batch_size]


def move_to_device(batch, device: torch.device):
    """`batch` with every tensor on `device` (dicts, lists, tuples, named tuples, `.to` objects)."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=batch.is_pinned())
    if isinstance(batch, dict):
        return type(batch)({k: move_to_device(v, device) for k, v in batch.items()}) \
            if type(batch) is not dict else {k: move_to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device) for v in batch)
    if hasattr(batch, "to") and callable(batch.to) and not isinstance(batch, torch.nn.Module):
        return batch.to(device)
    return batch


class _EpochBatches:
    """A batch sampler that shards the original batches of the loader's current epoch."""

    def __init__(self, prepared: "PreparedDataLoader"):
        self.prepared = prepared

    def __iter__(self):
        p = self.prepared
        return shard_rounds(p.epoch_batches(), p.world, p.rank, p.batch_size, p.drop_last)

    def __len__(self) -> int:
        p = self.prepared
        whole, left = divmod(len(p.original_batches), p.world)
        return whole + (1 if left and not p.drop_last and p.batch_size is not None else 0)


class PreparedDataLoader:
    """This rank's share of a DataLoader's batches, moved to the device (see the module doc)."""

    def __init__(self, loader: DataLoader, world: int, rank: int, device: torch.device | None,
                 seed: int, state=None):
        self.loader = loader
        self.world, self.rank, self.device = world, rank, device
        self.dataset = loader.dataset
        self.batch_size = loader.batch_size
        self.drop_last = loader.drop_last
        self.seed = seed
        self.epoch = 0
        self.state = state  # the Accelerator's loop state: end of data, remainder
        sampler = loader.sampler
        self.mode = "iterable" if isinstance(self.dataset, IterableDataset) else \
            "as-is" if isinstance(sampler, DistributedSampler) else "sharded"
        self.original_batches = loader.batch_sampler
        if self.mode == "sharded":
            kwargs = {k: getattr(loader, k) for k in _COPIED if hasattr(loader, k)}
            if kwargs.get("num_workers", 0) > 0 and getattr(loader, "prefetch_factor", None):
                kwargs["prefetch_factor"] = loader.prefetch_factor
            self.base = DataLoader(self.dataset, batch_sampler=_EpochBatches(self), **kwargs)
        else:
            self.base = loader

    # -- what the epoch draws ----------------------------------------------------------------------
    def epoch_batches(self):
        """The original loader's batches (index lists) for the current epoch."""
        sampler = self.loader.sampler
        if isinstance(sampler, RandomSampler):
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            sampler = RandomSampler(self.dataset, replacement=sampler.replacement,
                                    num_samples=sampler._num_samples, generator=generator)
        elif hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        if self.batch_size is None:
            return iter(self.loader.batch_sampler)
        return iter(BatchSampler(sampler, self.batch_size, self.drop_last))

    def set_epoch(self, epoch: int) -> None:
        """Use `epoch`'s order for the next iteration (Accelerate's and DistributedSampler's name)."""
        self.epoch = epoch
        if self.mode != "sharded" and hasattr(self.loader.sampler, "set_epoch"):
            self.loader.sampler.set_epoch(epoch)

    @property
    def total_dataset_length(self) -> int | None:
        """Samples in the dataset (None for an iterable one without a length)."""
        try:
            return len(self.dataset)
        except TypeError:
            return None

    def remainder(self) -> int:
        """Real samples in the last global batch when the last round was completed, else 0."""
        length = self.total_dataset_length
        if self.mode != "sharded" or self.drop_last or length is None or self.batch_size is None:
            return 0
        return length % (self.batch_size * self.world)

    # -- iteration ---------------------------------------------------------------------------------
    def _batches(self):
        if self.mode == "iterable":
            rounds = zip(*[iter(self.base)] * self.world)  # whole rounds only
            return (round_[self.rank] for round_ in rounds)
        return iter(self.base)

    def __iter__(self):
        if self.state is not None:
            self.state.begin(self)
        batches = self._batches()
        current = next(batches, _END)
        try:
            while current is not _END:
                following = next(batches, _END)
                if following is _END and self.state is not None:
                    self.state.mark_end(self)
                yield current if self.device is None else move_to_device(current, self.device)
                current = following
            self.epoch += 1
        finally:
            if self.state is not None:
                self.state.finish(self)

    def __len__(self) -> int:
        if self.mode == "iterable":
            return len(self.loader) // self.world
        return len(self.base)

    def state_dict(self) -> dict[str, int]:
        """What a resumed run needs to draw the same order: the seed and the epoch."""
        return {"seed": int(self.seed), "epoch": int(self.epoch)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the seed and epoch saved by `state_dict`."""
        self.seed, self.epoch = int(state["seed"]), int(state["epoch"])

    def __getattr__(self, name: str):
        loader = self.__dict__.get("loader")
        if loader is None:
            raise AttributeError(name)
        return getattr(loader, name)  # sampler, num_workers, ... of the original


class SkipBatches:
    """A prepared loader's iteration without its first `skip` batches (Accelerate's
    skip_first_batches, for resuming inside an epoch)."""

    def __init__(self, prepared: PreparedDataLoader, skip: int):
        self.prepared, self.skip = prepared, skip
        self.batch_size = prepared.batch_size
        self.dataset = prepared.dataset

    def __iter__(self):
        return itertools.islice(iter(self.prepared), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.prepared) - self.skip)


_END = object()
