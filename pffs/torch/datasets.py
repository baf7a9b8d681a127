"""PyTorch datasets of the objects under a prefix (or in a list of URLs), read through the pffs cache.

An item is a `PffsObject` (a seekable, read-only binary file with `.url` and `.key`, reading the object
through the cache in the DataLoader worker as it is consumed: see pffs.torch.objects), or `transform(obj)`
where a transform is given: what s3torchconnector's datasets hand their transforms, so those port
unchanged.

Resuming mid-epoch: both datasets have `state_dict()` and `load_state_dict(state)`, which torchdata's
`StatefulDataLoader` calls in each DataLoader worker (or in the training process with num_workers=0); save
`loader.state_dict()` in the checkpoint and give it to `loader.load_state_dict` of the restarted job.

- `MapDataset`: the sampler holds the position (StatefulDataLoader saves its RandomSampler's generator and
  how many indexes it gave, and skips those without reading them). The dataset's own state only names the
  listing it was saved over (object count and fingerprint), so a state of another dataset is refused.
  Restart with the same DataLoader arguments. (Give no `generator=` with num_workers=0: torchdata then
  draws from it after restoring it, and the epoch after the resumed one differs; seed torch instead.)
- `IterableDataset`: the state of each worker is its place in its share of the epoch: the epoch, seed,
  rank, world size, worker, and how many objects of its share it has yielded, with the listing's count and
  fingerprint. Loaded, the worker starts its share after those objects, none of which is read again; the
  rest of the epoch comes in the order it would have. The state's epoch rules that one iteration; later
  ones follow `set_epoch`, so the loop that calls `set_epoch(n)` before each epoch goes on unchanged.

A state saved over another listing, or with another seed, shuffle, drop_last, rank, world size or number
of workers, is refused with a ValueError that says what differs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.utils.data

from pffs.torch.objects import Entry, ObjectSource, PffsObject
from pffs.torch.sharding import SharedEpoch, epoch_order, rank_share, resolve_rank

log = logging.getLogger(__name__)

Transform = Callable[[PffsObject], Any]

STATE_VERSION = 1  # of the dicts state_dict() returns; a state of another version is refused


class _Objects:
    """What both datasets share: the objects, reading one into an item, and the listing's part of a state."""

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

    def _listing_state(self) -> dict[str, Any]:
        return {
            "dataset": f"pffs.torch.{type(self).__name__}",
            "version": STATE_VERSION,
            "objects": len(self._objects.entries),
            "fingerprint": self._objects.fingerprint,
        }

    def _check_listing(self, state: object) -> Mapping[str, Any]:
        """`state` as a mapping, once it is one of this kind of dataset, over this dataset's listing."""
        kind = f"pffs.torch.{type(self).__name__}"
        if not isinstance(state, Mapping) or not str(state.get("dataset", "")).startswith("pffs.torch."):
            raise ValueError(f"not a state of a {kind} (the dict its state_dict() returns): {state!r:.200}")
        if state["dataset"] != kind:
            raise ValueError(f"a state of a {state['dataset']}, not of a {kind}")
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"a {kind} state of version {state.get('version')!r}; this pffs reads version {STATE_VERSION}"
            )
        saved = (state.get("objects"), state.get("fingerprint"))
        mine = (len(self._objects.entries), self._objects.fingerprint)
        if saved != mine:
            raise ValueError(
                f"the state was saved over another listing ({saved[0]} objects, fingerprint {saved[1]}) than "
                f"this dataset's ({mine[0]} objects, fingerprint {mine[1]}): objects were added, removed or "
                "changed size since, or this is another dataset; start the epoch afresh instead"
            )
        return state


class MapDataset(_Objects, torch.utils.data.Dataset[Any]):
    """`dataset[i]` is the i-th object (sorted by key) under a prefix listed once, or of a list of URLs.

    `options` go to the pffs filesystem: cache settings (cache_dir, block_size, ...) and backend options
    (endpoint_url, key, secret, ...), flat or per layer (`s3={...}, pffs={...}`).

    Resuming mid-epoch is the sampler's: torchdata's StatefulDataLoader saves where its sampler was, and
    skips the indexes already given without reading them. `state_dict()` names the listing only, so that
    `load_state_dict` refuses a state saved over other objects.
    """

    def __init__(
        self, source: str | Sequence[str], transform: Transform | None = None, **options: Any
    ) -> None:
        super().__init__(source, transform, options)

    def __len__(self) -> int:
        return len(self._objects.entries)

    def __getitem__(self, index: int) -> Any:
        return self._item(self._objects.entries[index])

    def state_dict(self) -> dict[str, Any]:
        """The listing this dataset reads (object count and fingerprint), for StatefulDataLoader."""
        return self._listing_state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Checks that `state` was saved over this dataset's listing (ValueError if not)."""
        self._check_listing(state)


@dataclass
class _Place:
    """Where one DataLoader worker is in its share of an epoch: how many objects of it it has yielded."""

    epoch: int
    worker: int
    workers: int
    yielded: int = 0


def _this_worker() -> tuple[int, int]:
    """(id, number of workers) of this DataLoader worker; (0, 1) outside one (num_workers=0)."""
    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class IterableDataset(_Objects, torch.utils.data.IterableDataset[Any]):
    """Every object once per epoch, shared out between ranks and their DataLoader workers.

    The order is shuffled with `seed + epoch` (the same order on every rank); call `set_epoch(n)` before
    each epoch, as with DistributedSampler. rank and world_size default to torch.distributed's (make the
    dataset after init_process_group), else $RANK and $WORLD_SIZE, else 0 and 1. A rank's shares may differ
    by one object; drop_last=True drops the epoch's last objects so that every rank gets as many.

    With torchdata's StatefulDataLoader, a job restarted from `loader.state_dict()` goes on with the rest
    of the epoch, in order, without reading again an object it had yielded (see the module's docstring).
    """

    _SETTINGS = ("seed", "shuffle", "drop_last", "rank", "world_size")

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
        self._place: _Place | None = None  # of this process's latest iteration
        self._resume: _Place | None = None  # loaded, for the next iteration

    @property
    def epoch(self) -> int:
        return self._epoch.get()

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch whose order the next iteration follows (also in persistent DataLoader workers)."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch must be an integer of 0 or more, not {epoch!r}")
        self._epoch.set(epoch)

    def _rank_share(self, epoch: int | None = None) -> list[int]:
        order = epoch_order(
            len(self._objects.entries),
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=self.epoch if epoch is None else epoch,
        )
        return rank_share(order, self.rank, self.world_size, drop_last=self.drop_last)

    def _worker_share(self, place: _Place) -> list[int]:
        return self._rank_share(place.epoch)[place.worker :: place.workers]

    def __len__(self) -> int:
        """Objects this rank reads per epoch (over all its DataLoader workers)."""
        return len(self._rank_share())

    def __iter__(self) -> Iterator[Any]:
        # Not a generator itself: the place is set here, as iter() is called, for a state_dict() before the
        # first item (StatefulDataLoader asks for one at once).
        place, self._resume = self._resume, None
        if place is None:
            place = _Place(self.epoch, *_this_worker())
        elif (place.worker, place.workers) != _this_worker():
            worker, workers = _this_worker()
            raise ValueError(
                f"the state loaded is of DataLoader worker {place.worker} of {place.workers}, but it is "
                f"iterated in worker {worker} of {workers}: let StatefulDataLoader load the states"
            )
        share = self._worker_share(place)
        if place.epoch != self.epoch and place.yielded < len(share):
            log.info("going on with the state's epoch %d; set_epoch said %d", place.epoch, self.epoch)
        self._place = place
        return self._read(share[place.yielded :], place)

    def _read(self, rest: list[int], place: _Place) -> Iterator[Any]:
        for index in rest:
            item = self._item(self._objects.entries[index])
            place.yielded += 1  # before the item leaves: a state taken once it has counts it
            yield item

    def state_dict(self) -> dict[str, Any]:
        """This worker's place in its share of the epoch, for StatefulDataLoader (which calls it in each
        DataLoader worker): a dict of plain values, with the listing's object count and fingerprint."""
        place = self._resume or self._place or _Place(self.epoch, *_this_worker())
        return {
            **self._listing_state(),
            **{name: getattr(self, name) for name in self._SETTINGS},
            "epoch": place.epoch,
            "worker": place.worker,
            "num_workers": place.workers,
            "yielded": place.yielded,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The next iteration (in this worker) goes on where `state` was saved: the rest of that epoch's
        share, none of the objects yielded before read again. ValueError if `state` is not one of this
        dataset's: another listing, seed, shuffle, drop_last, rank, world size or number of workers."""
        state = self._check_listing(state)
        for name in self._SETTINGS:
            if state.get(name) != getattr(self, name):
                raise ValueError(
                    f"the state was saved with {name}={state.get(name)!r}, this dataset has "
                    f"{name}={getattr(self, name)!r}: resume with the same settings"
                )
        worker, workers = _this_worker()
        if (state.get("worker"), state.get("num_workers")) != (worker, workers):
            raise ValueError(
                f"the state is of DataLoader worker {state.get('worker')!r} of {state.get('num_workers')!r}, "
                f"this is worker {worker} of {workers}: resume with the same num_workers (0 and 1 are alike)"
            )
        place = _Place(_count(state, "epoch"), worker, workers, _count(state, "yielded"))
        share = len(self._worker_share(place))
        if place.yielded > share:
            raise ValueError(f"the state says {place.yielded} objects were yielded, of a share of {share}")
        self._resume = place


def _count(state: Mapping[str, Any], name: str) -> int:
    value = state.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"the state's {name} must be an integer of 0 or more, not {value!r}")
    return value
