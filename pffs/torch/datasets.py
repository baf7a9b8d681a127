"""PyTorch datasets of the objects under a prefix (or in a list of URLs), read through the pffs cache.

An item is a `PffsObject` (a binary file over the object's bytes, with `.url` and `.key`) read whole in
the DataLoader worker, or `transform(obj)` where a transform is given: what s3torchconnector's datasets
hand their transforms, so those port unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.utils.data

from pffs.torch.objects import Entry, ObjectSource, PffsObject
from pffs.torch.sharding import SharedEpoch, epoch_order, rank_share, resolve_rank

Transform = Callable[[PffsObject], Any]


class _Objects:
    """What both datasets share: the objects, and reading one into an item."""

    def __init__(self, source: str | Sequence[str], transform: Transform | None, options: dict[str, Any]):
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable, not {transform!r}")
        self._objects = ObjectSource(source, options)
        self.transform = transform

    @property
    def urls(self) -> list[str]:
        """Every object's URL, in the dataset's (sorted) order."""
        return [self._objects.url(entry) for entry in self._objects.entries]

    def _item(self, entry: Entry) -> Any:
        obj = self._objects.read(entry)
        return obj if self.transform is None else self.transform(obj)


class MapDataset(_Objects, torch.utils.data.Dataset[Any]):
    """`dataset[i]` is the i-th object (sorted by key) under a prefix listed once, or of a list of URLs.

    `options` go to the pffs filesystem: cache settings (cache_dir, block_size, ...) and backend options
    (endpoint_url, key, secret, ...), flat or per layer (`s3={...}, pffs={...}`).
    """

    def __init__(
        self, source: str | Sequence[str], transform: Transform | None = None, **options: Any
    ) -> None:
        super().__init__(source, transform, options)

    def __len__(self) -> int:
        return len(self._objects.entries)

    def __getitem__(self, index: int) -> Any:
        return self._item(self._objects.entries[index])


class IterableDataset(_Objects, torch.utils.data.IterableDataset[Any]):
    """Every object once per epoch, shared out between ranks and their DataLoader workers.

    The order is shuffled with `seed + epoch` (the same order on every rank); call `set_epoch(n)` before
    each epoch, as with DistributedSampler. rank and world_size default to torch.distributed's (make the
    dataset after init_process_group), else $RANK and $WORLD_SIZE, else 0 and 1. A rank's shares may differ
    by one object; drop_last=True drops the epoch's last objects so that every rank gets as many.
    """

    def __init__(
        self,
        source: str | Sequence[str],
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        transform: Transform | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed must be an integer, not {seed!r}")
        self.rank, self.world_size = resolve_rank(rank, world_size)
        super().__init__(source, transform, options)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._epoch = SharedEpoch()

    @property
    def epoch(self) -> int:
        return self._epoch.get()

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch whose order the next iteration follows (also in persistent DataLoader workers)."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch must be an integer of 0 or more, not {epoch!r}")
        self._epoch.set(epoch)

    def _rank_share(self) -> list[int]:
        order = epoch_order(
            len(self._objects.entries), shuffle=self.shuffle, seed=self.seed, epoch=self.epoch
        )
        return rank_share(order, self.rank, self.world_size, drop_last=self.drop_last)

    def __len__(self) -> int:
        """Objects this rank reads per epoch (over all its DataLoader workers)."""
        return len(self._rank_share())

    def __iter__(self) -> Iterator[Any]:
        worker = torch.utils.data.get_worker_info()
        mine = self._rank_share()
        if worker is not None:
            mine = mine[worker.id :: worker.num_workers]
        for index in mine:
            yield self._item(self._objects.entries[index])
