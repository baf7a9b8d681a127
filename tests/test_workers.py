"""DataLoader-style worker processes, however they end: every block a worker fetched is on disk and
counted once it is gone. (multiprocessing's workers leave through os._exit, and a DataLoader ends its
workers with SIGTERM: nothing that waits for an exit hook may hold a block or a count.)"""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from helpers import pattern, pffs_fs, sha256

from pffs.cache.stats import read_totals

FILES = 24  # one block each


def _read_then_end(fs: Any, names: list[str], how: str, ready: Any) -> None:
    digests = [sha256(fs.cat_file(n)) for n in names]
    ready.send(digests)
    if how == "os._exit":
        os._exit(0)  # as a multiprocessing worker leaves
    if how == "SIGTERM":
        signal.pause()  # ended by the parent's SIGTERM (a DataLoader shutting its workers down)


@pytest.mark.parametrize(
    ("start", "how"), [("fork", "os._exit"), ("fork", "SIGTERM"), ("spawn", "return"), ("spawn", "SIGTERM")]
)
def test_every_block_a_worker_fetched_is_on_disk_and_counted_however_it_ends(
    tmp_path: Path, start: str, how: str
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    files = {f"f{i}.bin": pattern(100_000 + i, seed=i) for i in range(FILES)}
    for name, content in files.items():
        (data / name).write_bytes(content)
    cache = tmp_path / "cache"
    fs = pffs_fs(str(data), cache, memory_cache_size="64M")
    names = sorted(files)
    context = multiprocessing.get_context(start)
    workers = []
    for part in (names[0::2], names[1::2]):  # two workers, half the files each
        mine, theirs = context.Pipe(duplex=False)
        worker = context.Process(target=_read_then_end, args=(fs, part, how, theirs))
        worker.start()
        workers.append((worker, part, mine))
    try:
        for worker, part, results in workers:
            assert results.poll(60), "a worker did not read its files in time"
            assert results.recv() == [sha256(files[n]) for n in part]
            if how == "SIGTERM":
                worker.terminate()
            worker.join(30)
            assert worker.exitcode == (-signal.SIGTERM if how == "SIGTERM" else 0)
    finally:
        for worker, _, _ in workers:
            if worker.is_alive():
                worker.kill()
                worker.join()
    totals = read_totals(cache / "stats.sqlite")
    assert (totals["misses"], totals["bytes_fetched"]) == (FILES, sum(map(len, files.values())))
    # Every block on disk: a second epoch in a fresh process fetches nothing, and is exact.
    epoch2 = context.Process(target=_second_epoch, args=(str(data), str(cache), files))
    epoch2.start()
    epoch2.join(60)
    assert epoch2.exitcode == 0
    totals = read_totals(cache / "stats.sqlite")
    assert (totals["misses"], totals["disk_hits"]) == (FILES, FILES), totals


def _second_epoch(data: str, cache: str, files: dict[str, bytes]) -> None:
    fs = pffs_fs(data, Path(cache), memory_cache_size="64M")
    for name, content in files.items():
        if sha256(fs.cat_file(name)) != sha256(content):
            os._exit(3)
