"""A clear word for the one form Hugging Face `datasets` cannot stream.

`datasets.load_dataset(..., data_files="pffs::s3://bucket/x/*.parquet", streaming=True)` resolves the
files through pffs, then opens each one with its own `xopen`, which takes the first hop of a chained URL
(`pffs`, with no `://`) for a local path and fails with `IsADirectoryError` or `FileNotFoundError: 'pffs'`:
nothing that names the cause. pffs cannot change `datasets`; it can see, when it is made for a chained URL,
that `load_dataset(streaming=True)` is what asked, and refuse with the form that works.
"""

from __future__ import annotations

import sys

STREAMING_FORM = (
    "Hugging Face datasets cannot stream a chained URL (pffs::s3://...): with streaming=True use "
    "data_files='pffs://bucket/path/*.parquet' and storage_options={'pffs': {'target_protocol': 's3', "
    "'target_options': {<s3 options>}, 'cache_dir': ...}} (without streaming, both forms work)"
)


def refuse_chained_streaming() -> None:
    """Raises ValueError(STREAMING_FORM) if `datasets.load_dataset(..., streaming=True)` is on the stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if (
            frame.f_code.co_name == "load_dataset"
            and frame.f_globals.get("__name__") == "datasets.load"
            and frame.f_locals.get("streaming") is True
        ):
            raise ValueError(STREAMING_FORM)
        frame = frame.f_back  # type: ignore[assignment]
