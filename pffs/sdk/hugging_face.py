"""What pffs does for Hugging Face `datasets`, which builds its own fsspec filesystems from the
`storage_options` a user gives `load_dataset`.

pffs's options of a chained URL. `datasets` splits `storage_options` per hop of a URL and keeps, for a hop,
only the options under that hop's protocol (`datasets.utils.file_utils._prepare_single_hop_path_and_
storage_options`). The first hop of `pffs::s3://bucket/x` is `pffs`, with no `://`, which it takes for a
local path: `storage_options["pffs"]` is dropped, the pffs layer is made with no options of its own, and
the data goes to the default cache under the home folder instead of the `cache_dir` given. So when a pffs
filesystem is made for a chained URL while `datasets` is on the stack, the options under "pffs" of the
DownloadConfig `datasets` is working with fill the options the pffs layer was not given (see
`PffsFileSystem`'s metaclass: they take part in fsspec's instance cache key like any others).

The one form `datasets` cannot stream. `datasets.load_dataset(..., data_files="pffs::s3://bucket/x/*.parquet",
streaming=True)` resolves the files through pffs, then opens each one with its own `xopen`, which takes the
first hop of a chained URL (`pffs`, with no `://`) for a local path and fails with `IsADirectoryError` or
`FileNotFoundError: 'pffs'`: nothing that names the cause. pffs cannot change `datasets`; it can see, when
it is made for a chained URL, that `load_dataset(streaming=True)` is what asked, and refuse with the form
that works.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

STREAMING_FORM = (
    "Hugging Face datasets cannot stream a chained URL (pffs::s3://...): with streaming=True use "
    "data_files='pffs://bucket/path/*.parquet' and storage_options={'pffs': {'target_protocol': 's3', "
    "'target_options': {<s3 options>}, 'cache_dir': ...}} (without streaming, both forms work)"
)

# What names the backend in pffs's own options: never taken for a chained URL, whose backend is its own.
_TARGET = {"target", "target_protocol", "target_options", "fo"}


def refuse_chained_streaming() -> None:
    """Raises ValueError(STREAMING_FORM) if `datasets.load_dataset(..., streaming=True)` is on the stack."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if (
            frame.f_code.co_name == "load_dataset"
            and frame.f_globals.get("__name__") == "datasets.load"
            and frame.f_locals.get("streaming") is True
        ):
            raise ValueError(STREAMING_FORM)
        frame = frame.f_back


def chained_options_from_datasets() -> dict[str, Any]:
    """pffs's options (`storage_options={"pffs": {...}}`) of the `datasets` call on this thread's stack that
    is making a filesystem, without those naming the backend; {} if there is none (or `datasets` was never
    imported: then this costs a dict lookup)."""
    if "datasets" not in sys.modules:
        return {}
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if str(frame.f_globals.get("__name__", "")).startswith("datasets."):
            found = _pffs_options(frame.f_locals)
            if found is not None:
                return {k: v for k, v in found.items() if k not in _TARGET}
        frame = frame.f_back
    return {}


def _pffs_options(local: dict[str, Any]) -> dict[str, Any] | None:
    """storage_options["pffs"] of a `datasets` frame's DownloadConfig (or of load_dataset's own
    `storage_options` argument); None if the frame has neither."""
    config = local.get("download_config")
    options = getattr(config, "storage_options", None) if config is not None else local.get("storage_options")
    if not isinstance(options, dict):
        return None
    nested = options.get("pffs")
    return nested if isinstance(nested, dict) else None
