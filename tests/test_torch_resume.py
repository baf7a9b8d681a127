"""Resuming pffs.torch datasets mid-epoch with torchdata's StatefulDataLoader, against the local S3 server.

A job reads k batches, saves `loader.state_dict()` and stops; a job restarted on a fresh cache directory
loads it, reads the rest of the epoch and the next one. What both jobs read, item by item and in order,
must be what one uninterrupted job reads, with every byte checked against the source; and the restarted
job must fetch from S3 only the objects not yet yielded (its cache's misses and bytes fetched, and the GETs
its workers made). A state of another dataset is refused with one clear message."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import pattern, require, sha256

# A few dozen small objects: one block each (of 256K), so one GET and one cache miss per object read.
COUNT = 29
BATCH = 3
STOP = 4  # batches the first job reads before it stops


@pytest.fixture(autouse=True)
def _torchdata() -> None:
    missing = [
        name
        for name, module in (("torch (the dev extra: make setup)", "torch"), ("torchdata", "torchdata"))
        if importlib.util.find_spec(module) is None
    ]
    require(missing, "resuming pffs.torch datasets")


@pytest.fixture
def objects(raw_s3: Any, bucket: str) -> dict[str, bytes]:
    """key -> bytes of the dataset under s3://bucket/train/."""
    data = {f"train/{i:02d}.bin": pattern(1000 + 137 * i, seed=i) for i in range(COUNT)}
    raw_s3.pipe({f"{bucket}/{key}": value for key, value in data.items()})
    return data


@pytest.fixture
def options(s3_options: dict[str, Any], cache_dir: Path) -> dict[str, Any]:
    return {**s3_options, "cache_dir": str(cache_dir), "block_size": "256K"}


RESUME = """
import functools, gc, hashlib, json, os, sys
import fsspec, torch
from torchdata.stateful_dataloader import StatefulDataLoader
from pffs.cache.stats import read_totals
from pffs.torch import IterableDataset, MapDataset

EPOCH = 2  # the epoch stopped and resumed (not 0: the state, not a default, must carry it)


def fingerprint(options, obj):  # module-level: spawned workers unpickle it by name
    backend = fsspec.filesystem("pffs", target_protocol="s3", **options).vfs.backend
    gets = backend.requests.snapshot()["get"]["requests"]  # this process's, this read's included
    return obj.key, hashlib.sha256(obj.read()).hexdigest(), os.getpid(), gets


def make(config, url, options, cache_dir, seed):
    opts = {**options, "cache_dir": cache_dir}
    transform = functools.partial(fingerprint, opts)
    kwargs = dict(batch_size=BATCH, collate_fn=list, num_workers=config["workers"])
    if config["workers"]:
        kwargs.update(multiprocessing_context=config["start"], persistent_workers=config["persistent"])
    if config["kind"] == "map":
        datasets = [MapDataset(url, transform=transform, **opts)]
        # Its sampler seeds itself from torch's RNG. (No generator= here: with one, torchdata's num_workers=0
        # iterator draws from it after restoring it, and the epoch after the resumed one is another.)
        torch.manual_seed(seed)
        kwargs.update(shuffle=True)
    else:
        world_size = config["world_size"]
        datasets = [
            IterableDataset(url, seed=3, rank=r, world_size=world_size, transform=transform, **opts)
            for r in range(world_size)
        ]
    return datasets, [StatefulDataLoader(dataset, **kwargs) for dataset in datasets]


def epoch(datasets, loaders, number, stop=None):
    ranks = []
    for dataset, loader in zip(datasets, loaders):
        if isinstance(dataset, IterableDataset):
            dataset.set_epoch(number)
        items = []
        for i, batch in enumerate(loader):
            items.extend(list(item) for item in batch)
            if i + 1 == stop:
                break
        ranks.append(items)
    return ranks


def dataset_states(state):
    \"\"\"The pffs dataset states inside a StatefulDataLoader's (one per worker).\"\"\"
    if isinstance(state, dict):
        if str(state.get("dataset", "")).startswith("pffs.torch."):
            return [state]
        state = list(state.values())
    if isinstance(state, (list, tuple)):
        return [found for value in state for found in dataset_states(value)]
    return []


def run(config, url, options, root):
    seed = 5  # of the map dataset's sampler: the same in the restarted job, as the same code restarted has
    datasets, loaders = make(config, url, options, f"{root}/whole", seed)
    whole = [epoch(datasets, loaders, EPOCH), epoch(datasets, loaders, EPOCH + 1)]
    del datasets, loaders

    datasets, loaders = make(config, url, options, f"{root}/first", seed)
    first = epoch(datasets, loaders, EPOCH, stop=STOP)
    torch.save({"epoch": EPOCH, "loaders": [loader.state_dict() for loader in loaders]}, f"{root}/state.pt")
    del datasets, loaders
    gc.collect()

    # The restarted job: new datasets, loaders and workers, and a cache that holds nothing yet.
    datasets, loaders = make(config, url, options, f"{root}/resumed", seed)
    saved = torch.load(f"{root}/state.pt")
    for loader, state in zip(loaders, saved["loaders"]):
        loader.load_state_dict(state)
    rest = epoch(datasets, loaders, saved["epoch"])
    totals = read_totals(f"{root}/resumed/stats.sqlite")
    after = epoch(datasets, loaders, saved["epoch"] + 1)
    return {
        "whole": whole, "first": first, "rest": rest, "next": after, "totals": totals,
        "states": dataset_states(saved["loaders"]),
    }


if __name__ == "__main__":
    url, root, options, configs = sys.argv[1], sys.argv[2], *map(json.loads, sys.argv[3:5])
    BATCH, STOP = int(sys.argv[5]), int(sys.argv[6])
    reports = []
    for i, config in enumerate(configs):
        os.makedirs(f"{root}/{i}")
        reports.append(run(config, url, options, f"{root}/{i}"))
    print(json.dumps(reports))
"""

# One subprocess per start method (importing torch is most of its time): the configurations it resumes.
CONFIGS = {
    "fork": [
        {"kind": "iterable", "workers": 2, "start": "fork", "persistent": False, "world_size": 1},
        {"kind": "iterable", "workers": 2, "start": "fork", "persistent": True, "world_size": 2},
        {"kind": "iterable", "workers": 0, "world_size": 2},
        {"kind": "map", "workers": 2, "start": "fork", "persistent": False},
        {"kind": "map", "workers": 0},
    ],
    # spawned workers import torch (seconds each): the iterable dataset alone
    "spawn": [{"kind": "iterable", "workers": 2, "start": "spawn", "persistent": True, "world_size": 1}],
}


def _pairs(items: list[list[Any]]) -> list[tuple[str, str]]:
    return [(key, digest) for key, digest, _, _ in items]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_restarted_job_reads_the_rest_of_the_epoch_in_order_and_only_that(
    objects: dict[str, bytes], bucket: str, options: dict[str, Any], tmp_path: Path, start: str
) -> None:
    """The first job's items then the restarted job's are the uninterrupted epoch's, object by object in
    order, per rank; the next epoch is the uninterrupted one's; and the restarted job fetched exactly the
    objects it yielded (one GET, one miss, their bytes each): none of those the first job had yielded."""
    script = tmp_path / "resume.py"
    script.write_text(RESUME)
    loader_options = {k: v for k, v in options.items() if k != "cache_dir"}
    result = subprocess.run(
        [sys.executable, str(script), f"s3://{bucket}/train", str(tmp_path / "runs"),
         json.dumps(loader_options), json.dumps(CONFIGS[start]), str(BATCH), str(STOP)],
        capture_output=True, text=True, timeout=230,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "naively fast-forwarding" not in result.stderr, result.stderr[-3000:]
    digests = {key: sha256(data) for key, data in objects.items()}
    for config, report in zip(CONFIGS[start], json.loads(result.stdout), strict=True):
        whole, after = report["whole"]
        assert whole != after, config  # a new order in the next epoch, so that comparing it means something
        for rank, items in enumerate(whole):
            first, rest = report["first"][rank], report["rest"][rank]
            assert len(first) == STOP * BATCH and rest, (config, rank)
            assert _pairs(first) + _pairs(rest) == _pairs(items), (config, rank)
            assert _pairs(report["next"][rank]) == _pairs(after[rank]), (config, rank)
            assert all(digest == digests[key] for key, digest in _pairs(items)), (config, rank)
        assert sorted(key for items in whole for key, _ in _pairs(items)) == sorted(objects), config

        resumed = [item for items in report["rest"] for item in items]
        yielded_before = {key for items in report["first"] for key, _ in _pairs(items)}
        assert not yielded_before & {key for key, _ in _pairs(resumed)}, config
        totals = report["totals"]
        size = sum(len(objects[key]) for key, _ in _pairs(resumed))
        assert (totals["misses"], totals["bytes_fetched"]) == (len(resumed), size), (config, totals)
        gets: dict[int, int] = {}
        for _, _, pid, count in resumed:  # a process's GETs so far, as each item was read
            gets[pid] = max(gets.get(pid, 0), count)
        assert sum(gets.values()) == len(resumed), (config, gets)

        # What the states hold: the listing's count, and per worker of the iterable one its place
        states = report["states"]
        assert {state["objects"] for state in states} == {len(objects)}, states
        if config["kind"] == "iterable":
            workers = max(config["workers"], 1)
            assert len(states) == config["world_size"] * workers, states
            assert sum(state["yielded"] for state in states) == len(yielded_before), states
            assert {(state["epoch"], state["seed"], state["num_workers"]) for state in states} == {
                (2, 3, workers)
            }, states


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc.value)
    assert message and "\n" not in message and "Traceback" not in message, message
    return message


def test_a_state_of_another_dataset_is_refused_with_a_clear_message(
    objects: dict[str, bytes], raw_s3: Any, bucket: str, options: dict[str, Any], tmp_path: Path
) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    from pffs.torch import IterableDataset, MapDataset

    url = f"s3://{bucket}/train"
    dataset = IterableDataset(url, seed=3, rank=0, world_size=1, **options)
    dataset.set_epoch(1)
    read = [item.key for _, item in zip(range(5), dataset, strict=False)]
    state = json.loads(json.dumps(dataset.state_dict()))  # plain values: any checkpoint format holds them
    assert (state["epoch"], state["yielded"], state["objects"]) == (1, 5, COUNT)

    # Loaded into a dataset over the same listing (epoch 0 set: the state's epoch rules the rest of it)
    again = IterableDataset(url, seed=3, rank=0, world_size=1, **options)
    again.load_state_dict(state)
    assert again.state_dict() == state
    rest = [item.key for item in again]
    dataset.set_epoch(1)
    assert read + rest == [item.key for item in dataset]
    assert again.state_dict()["yielded"] == COUNT
    assert [item.key for item in again] != read + rest  # epoch 0, as set_epoch says, once resumed

    # A job restarted (a filesystem of its own: this one's listings are fresh) after an object was added
    raw_s3.pipe(f"{bucket}/train/zz-new.bin", b"added after the state was saved")
    options = {**options, "cache_dir": str(tmp_path / "restarted")}
    other = f"s3://{bucket}/other"
    raw_s3.pipe({f"{bucket}/other/{i}.bin": pattern(100, seed=i) for i in range(10)})
    cases: list[tuple[Any, Any, str]] = [
        (IterableDataset(url, seed=3, rank=0, world_size=1, **options), state,
         f"saved over another listing ({COUNT} objects, fingerprint {state['fingerprint']}) than this "
         f"dataset's ({COUNT + 1} objects"),
        (IterableDataset(other, seed=3, rank=0, world_size=1, **options), state,
         "10 objects"),
        (MapDataset(other, **options), state,
         "a state of a pffs.torch.IterableDataset, not of a pffs.torch.MapDataset"),
        (again, {**state, "seed": 4}, "the state was saved with seed=4, this dataset has seed=3"),
        (again, {**state, "worker": 1, "num_workers": 2}, "the state is of DataLoader worker 1 of 2"),
        (again, {**state, "yielded": COUNT + 1}, f"{COUNT + 1} objects were yielded, of a share of {COUNT}"),
        (again, {**state, "version": 9}, "this pffs reads version 1"),
        (again, {"step": 3}, "not a state of a pffs.torch.IterableDataset"),
    ]  # fmt: skip
    for target, given, message in cases:
        with pytest.raises(ValueError) as exc:
            target.load_state_dict(given)
        assert message in _one_line(exc), message
    map_state = MapDataset(url, **options).state_dict()
    assert map_state["objects"] == COUNT + 1
    with pytest.raises(ValueError) as exc:
        MapDataset(other, **options).load_state_dict(map_state)
    assert f"saved over another listing ({COUNT + 1} objects" in _one_line(exc)

    # Through StatefulDataLoader: a loader's state given to a loader over other objects
    loader = StatefulDataLoader(dataset, batch_size=2, collate_fn=list)
    next(iter(loader))
    changed = StatefulDataLoader(
        IterableDataset(url, seed=3, rank=0, world_size=1, **options), batch_size=2, collate_fn=list
    )
    changed.load_state_dict(loader.state_dict())
    with pytest.raises(ValueError) as exc:
        iter(changed)
    assert "saved over another listing" in _one_line(exc)
