"""pffs.torch against the local S3 server: the map-style and iterable datasets (in this process, and in
DataLoader workers forked and spawned, persistent and not), sharding over ranks x workers, the seeded
shuffle, checkpoints, and what a mistaken argument says. Every read is compared with the source."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import fsspec
import pytest
from helpers import pattern, require, sha256

from pffs.backends.errors import BadOptionError

BLOCK = 256 << 10
# An empty object, objects of one block and of several, sizes that end mid-block.
SIZES = [0, 1, 70_000, BLOCK, BLOCK + 1, 300_000, 450_000, 2 * BLOCK + 7, 600_000, 800_000]


@pytest.fixture(autouse=True)
def _torch() -> None:
    require([] if importlib.util.find_spec("torch") else ["torch (the dev extra: make setup)"], "pffs.torch")


@pytest.fixture
def objects(raw_s3: Any, bucket: str) -> dict[str, bytes]:
    """key -> bytes of the dataset under s3://bucket/train/ (and one object beside it, not in it)."""
    data = {f"train/{i:02d}-{size}.bin": pattern(size, seed=i) for i, size in enumerate(SIZES)}
    raw_s3.pipe({f"{bucket}/{key}": value for key, value in data.items()})
    raw_s3.pipe(f"{bucket}/train-other.bin", b"not under the prefix")
    return data


@pytest.fixture
def options(s3_options: dict[str, Any], cache_dir: Path) -> dict[str, Any]:
    return {**s3_options, "cache_dir": str(cache_dir), "block_size": "256K"}


def _blocks(data: dict[str, bytes]) -> int:
    return sum(math.ceil(len(value) / BLOCK) for value in data.values())


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc.value)
    assert message and "\n" not in message and "Traceback" not in message, message
    return message


def test_map_dataset_lists_the_prefix_once_and_reads_each_object_exactly(
    objects: dict[str, bytes], bucket: str, options: dict[str, Any]
) -> None:
    from pffs.torch import MapDataset

    dataset = MapDataset(f"s3://{bucket}/train", **options)
    keys = sorted(objects)
    assert len(dataset) == len(objects)
    assert dataset.urls == [f"s3://{bucket}/{key}" for key in keys]
    for i, key in enumerate(keys):
        item = dataset[i]
        assert (item.key, item.url) == (key, f"s3://{bucket}/{key}")
        assert sha256(item.read()) == sha256(objects[key])
    assert dataset[-1].getvalue() == objects[keys[-1]]
    # An item travels from a DataLoader worker pickled: whole, with its names, at its position.
    item = dataset[3]
    item.seek(10)
    copy = pickle.loads(pickle.dumps(item))
    assert (copy.key, copy.url, copy.tell(), copy.read()) == (keys[3], item.url, 10, objects[keys[3]][10:])
    with pytest.raises(IndexError):
        dataset[len(objects)]
    # One LIST, and no HEAD per object: reads are pinned to the versions the listing named.
    requests = fsspec.filesystem("pffs", target_protocol="s3", **options).vfs.backend.requests.snapshot()
    assert (requests["list"]["requests"], requests["head"]["requests"]) == (1, 0), requests

    # The chained URL with options per layer, a transform, and a list of URLs (kept in the order given).
    s3 = {k: v for k, v in options.items() if k not in ("cache_dir", "block_size")}
    chained = MapDataset(
        f"pffs::s3://{bucket}/train/",
        transform=lambda obj: (obj.key, sha256(obj.read())),
        s3=s3,
        pffs={"cache_dir": options["cache_dir"], "block_size": "256K"},
    )
    assert [chained[i] for i in range(len(chained))] == [(key, sha256(objects[key])) for key in keys]
    picked = [keys[5], keys[0], keys[9]]
    listed = MapDataset([f"s3://{bucket}/{key}" for key in picked], **options)
    assert [(item.key, item.getvalue()) for item in listed] == [(key, objects[key]) for key in picked]


def _keys(dataset: Any) -> list[str]:
    return [item.key for item in dataset]


def test_iterable_dataset_shards_over_ranks_and_shuffles_per_epoch(
    objects: dict[str, bytes], bucket: str, options: dict[str, Any]
) -> None:
    from pffs.torch import IterableDataset
    from pffs.torch.sharding import epoch_order

    keys = sorted(objects)
    url = f"s3://{bucket}/train"
    whole = IterableDataset(url, seed=7, rank=0, world_size=1, **options)
    ranks = [IterableDataset(url, seed=7, rank=r, world_size=3, **options) for r in range(3)]
    orders = []
    for epoch in (0, 1):
        for dataset in (whole, *ranks):
            dataset.set_epoch(epoch)
        items = list(whole)
        assert [sha256(item.getvalue()) for item in items] == [sha256(objects[item.key]) for item in items]
        order = [item.key for item in items]
        assert sorted(order) == keys
        assert order == [keys[i] for i in epoch_order(len(keys), shuffle=True, seed=7, epoch=epoch)]
        shares = [_keys(dataset) for dataset in ranks]
        # Every rank follows the one order: rank r reads every third object of it from r on.
        assert shares == [order[r::3] for r in range(3)]
        assert [len(dataset) for dataset in ranks] == [4, 3, 3]
        orders.append(order)
    assert orders[0] != orders[1]
    whole.set_epoch(0)
    assert _keys(whole) == orders[0]  # the same seed and epoch, the same order
    assert _keys(IterableDataset(url, seed=8, rank=0, world_size=1, **options)) != orders[0]
    assert _keys(IterableDataset(url, shuffle=False, rank=0, world_size=1, **options)) == keys
    even = [IterableDataset(url, drop_last=True, rank=r, world_size=3, **options) for r in range(3)]
    shares = [_keys(dataset) for dataset in even]
    assert [len(share) for share in shares] == [3, 3, 3] == [len(dataset) for dataset in even]
    assert len(set().union(*shares)) == 9


LOADER = """
import gc, hashlib, json, multiprocessing, sys
import fsspec, torch
from pffs.cache.stats import read_totals
from pffs.torch import IterableDataset, MapDataset


def fingerprint(obj):  # a module-level function: spawned workers unpickle it by name
    worker = torch.utils.data.get_worker_info()
    return obj.key, hashlib.sha256(obj.read()).hexdigest(), worker.id if worker else -1


def run(url, cache_dir, kind, start, persistent, world_size, options):
    \"\"\"Two epochs of one dataset (one DataLoader with 2 workers per rank); what was read, and the cache's
    counts after each epoch and once the workers are gone.\"\"\"
    opts = {**options, "cache_dir": cache_dir}
    if kind == "map":
        datasets = [MapDataset(url, transform=fingerprint, **opts)]
    else:
        datasets = [
            IterableDataset(url, seed=3, rank=r, world_size=world_size, transform=fingerprint, **opts)
            for r in range(world_size)
        ]
    loaders = [
        torch.utils.data.DataLoader(
            dataset, batch_size=None, num_workers=2, multiprocessing_context=start,
            persistent_workers=persistent,
        )
        for dataset in datasets
    ]
    epochs, totals = [], []
    for epoch in range(2):
        ranks = []
        for dataset, loader in zip(datasets, loaders):
            if kind == "iterable":
                dataset.set_epoch(epoch)
            ranks.append([list(item) for item in loader])
        epochs.append(ranks)
        totals.append(read_totals(cache_dir + "/stats.sqlite"))
    del loaders, loader
    gc.collect()
    fs = fsspec.filesystem("pffs", target=url, skip_instance_cache=True, **opts)
    return {
        "epochs": epochs,
        "totals": totals,
        "workers_left": len(multiprocessing.active_children()),
        "after": read_totals(cache_dir + "/stats.sqlite"),
        "cached": {name: fs.cached_fraction(name) for name in fs.find("")},
    }


if __name__ == "__main__":
    url, cache_root, runs, options = *sys.argv[1:3], *map(json.loads, sys.argv[3:5])
    reports = [run(url, f"{cache_root}/{i}", **config, options=options) for i, config in enumerate(runs)]
    print(json.dumps(reports))
"""

# One subprocess per start method (importing torch is most of its time): the runs it makes.
RUNS = {
    "fork": [
        {"kind": kind, "start": "fork", "persistent": persistent, "world_size": ranks}
        for kind in ("map", "iterable")
        for persistent, ranks in ((True, 1), (False, 2 if kind == "iterable" else 1))
    ],
    # spawned workers import torch (seconds each): the iterable dataset alone, whose shared epoch number
    # must reach them as they start
    "spawn": [{"kind": "iterable", "start": "spawn", "persistent": True, "world_size": 1}],
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_dataloader_workers_read_every_object_once_per_epoch_and_leave_every_block_on_disk(
    objects: dict[str, bytes], bucket: str, options: dict[str, Any], tmp_path: Path, start: str
) -> None:
    """Both datasets, 2 epochs, 2 workers (per simulated rank), persistent and not: exact bytes, each
    object once per epoch, the iterable one's shares (rank x worker) and order as the seeded shuffle says,
    a new order in epoch 2 (set_epoch reaches persistent workers), the first epoch all fetches (a miss per
    object, its other blocks read ahead) and the second all hits, and every block on disk once the workers
    are gone."""
    from pffs.torch.sharding import epoch_order

    script = tmp_path / "loader.py"
    script.write_text(LOADER)
    loader_options = {k: v for k, v in options.items() if k != "cache_dir"}
    result = subprocess.run(
        [sys.executable, str(script), f"s3://{bucket}/train", str(tmp_path / "c"), json.dumps(RUNS[start]),
         json.dumps(loader_options)],
        capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    keys = sorted(objects)
    digests = {key: sha256(data) for key, data in objects.items()}
    blocks = _blocks(objects)
    firsts = sum(1 for data in objects.values() if data)  # objects with a first block
    for config, report in zip(RUNS[start], json.loads(result.stdout), strict=True):
        world_size = config["world_size"]
        orders = []
        for epoch, ranks in enumerate(report["epochs"]):
            order = keys
            if config["kind"] == "iterable":
                order = [keys[i] for i in epoch_order(len(keys), shuffle=True, seed=3, epoch=epoch)]
            orders.append(order)
            read = [key for items in ranks for key, _, _ in items]
            assert sorted(read) == keys, config  # each object once across ranks and workers
            for rank, items in enumerate(ranks):
                assert [digest for _, digest, _ in items] == [digests[key] for key, _, _ in items], config
                share = order[rank::world_size]
                for worker in (0, 1):  # a map dataset's sampler deals indexes out as an iterable's split
                    assert [key for key, _, w in items if w == worker] == share[worker::2], config
        if config["kind"] == "iterable":
            assert orders[0] != orders[1], config
        first, second = report["totals"]
        # An object's first block is fetched as its item is made (a miss), the rest ahead of the transform
        # reading them (prefetches): every block once in the first epoch, none in the second.
        fetched = (first["misses"], first["prefetches"])
        assert fetched == (firsts, blocks - firsts), (config, first)
        assert first["memory_hits"] + first["disk_hits"] == 0, (config, first)
        assert (second["misses"], second["prefetches"]) == fetched, second
        assert second["memory_hits"] + second["disk_hits"] == blocks, second
        assert first["bytes_fetched"] == second["bytes_fetched"] == sum(map(len, objects.values()))
        assert report["workers_left"] == 0, config
        assert report["after"] == second, config
        assert report["cached"] == {key.removeprefix("train/"): 1.0 for key in keys}, config


def test_checkpoints_round_trip_and_a_load_sees_another_writers_overwrite(
    raw_s3: Any, bucket: str, options: dict[str, Any], tmp_path: Path
) -> None:
    import io

    import torch

    from pffs.torch import load, save

    url = f"s3://{bucket}/runs/a/model.pt"
    first = {"weights": torch.arange(300_000, dtype=torch.float32), "step": 1}
    save(first, url, **options)
    got = load(url, **options)
    assert torch.equal(got["weights"], first["weights"]) and got["step"] == 1
    with raw_s3.open(f"{bucket}/runs/a/model.pt", "rb") as f:  # what S3 holds, read without pffs
        assert torch.equal(torch.load(io.BytesIO(f.read()))["weights"], first["weights"])

    # Another writer replaces it: the next load (same process, metadata still fresh) reads the new one.
    second = {"weights": torch.ones(300_000), "step": 2}
    buffer = io.BytesIO()
    torch.save(second, buffer)
    raw_s3.pipe(f"{bucket}/runs/a/model.pt", buffer.getvalue())
    got = load(url, **options)
    assert got["step"] == 2 and torch.equal(got["weights"], second["weights"])

    # A save that fails leaves the checkpoint there whole, and nothing staged behind.
    with pytest.raises(Exception, match="pickle"):
        save({"step": 3, "bad": lambda: 0}, url, **options)
    assert load(url, **options)["step"] == 2
    assert list((Path(options["cache_dir"]) / "staging").iterdir()) == []
    # Through the chained URL and per-layer options, and on local disk (renamed into place).
    s3 = {k: v for k, v in options.items() if k not in ("cache_dir", "block_size")}
    save({"step": 4}, f"pffs::s3://{bucket}/runs/b.pt", s3=s3, pffs={"cache_dir": options["cache_dir"]})
    assert load(f"s3://{bucket}/runs/b.pt", **options) == {"step": 4}
    local = tmp_path / "ckpt" / "model.pt"
    save({"step": 5}, str(local), cache_dir=options["cache_dir"])
    with pytest.raises(Exception, match="pickle"):
        save({"bad": lambda: 0}, str(local), cache_dir=options["cache_dir"])
    assert load(str(local), cache_dir=options["cache_dir"]) == {"step": 5}
    assert os.listdir(local.parent) == ["model.pt"]


def test_mistaken_arguments_are_one_clear_error(
    objects: dict[str, bytes], bucket: str, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pffs.torch import IterableDataset, MapDataset

    url = f"s3://{bucket}/train"
    cases: list[tuple[type[BaseException], str, Any]] = [
        (ValueError, "rank must be from 0 to world_size - 1 = 1, not 2", dict(rank=2, world_size=2)),
        (ValueError, "world_size must be at least 1, not 0", dict(rank=0, world_size=0)),
        (ValueError, "give both rank and world_size", dict(rank=1)),
        (TypeError, "seed must be an integer", dict(seed="7")),
        (TypeError, "transform must be callable", dict(transform="decode")),
        (BadOptionError, "'endpont_url' (did you mean 'endpoint_url'?)", dict(endpont_url="http://x")),
    ]
    for error, message, kwargs in cases:
        with pytest.raises(error) as exc:
            IterableDataset(url, **{**options, **kwargs})
        assert message in _one_line(exc)
    for error, message, source in [
        (FileNotFoundError, f"s3://{bucket}/nothing: no objects there", f"s3://{bucket}/nothing"),
        (ValueError, "no URLs given", []),
        (ValueError, "URLs of one scheme only, not file and s3", [f"{url}/a", "/tmp/b"]),
        (TypeError, "a URL must be a string", [Path("/tmp/b")]),
        (ValueError, "name the backend", f"pffs://{bucket}/train"),
    ]:
        with pytest.raises(error) as exc:
            MapDataset(source, **options)
        assert message in _one_line(exc)
    with pytest.raises(ValueError) as exc:
        IterableDataset(url, **options).set_epoch(-1)
    assert "epoch must be an integer of 0 or more" in _one_line(exc)
    # rank and world size from the environment torchrun sets, and a mistake there named
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert (IterableDataset(url, **options).rank, IterableDataset(url, **options).world_size) == (1, 2)
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError) as exc:
        IterableDataset(url, **options)
    assert "$RANK is 'one' in the environment" in _one_line(exc)


def test_import_pffs_does_not_import_torch() -> None:
    code = "import sys, pffs, pffs.sdk; pffs.open; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr
