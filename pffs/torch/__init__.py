"""PyTorch datasets and checkpoints over pffs (needs torch: `pip install 'pffs[torch]'`).

    from pffs.torch import DcpReader, DcpWriter, IterableDataset, MapDataset, load, save

    train = MapDataset("s3://datasets/imagenet/train", transform=decode, endpoint_url="http://...")
    stream = IterableDataset("s3://datasets/shards", shuffle=True, seed=0, transform=decode)
    loader = torch.utils.data.DataLoader(stream, batch_size=64, num_workers=8)

An item is a `PffsObject` (a seekable, read-only binary file that reads the object through the cache as
it is consumed, with `.url` and `.key`) or what the transform makes of it. Every process — each DataLoader
worker, forked or spawned — reads through its own pffs filesystem and the one disk cache of the machine.
`import pffs` does not import torch; this does.

`DcpWriter` and `DcpReader` (`pffs.torch.dcp.Writer` and `Reader`) are torch.distributed.checkpoint's
storage writer and reader through pffs: `dcp.save(state_dict, storage_writer=DcpWriter("s3://...", ...))`.
They import torch.distributed on first use, not here.
"""

from typing import TYPE_CHECKING, Any

try:
    import torch  # noqa: F401
except ImportError:
    raise ImportError("pffs.torch needs PyTorch: pip install 'pffs[torch]'") from None

from pffs.torch.checkpoints import load, save
from pffs.torch.datasets import IterableDataset, MapDataset
from pffs.torch.objects import PffsObject

if TYPE_CHECKING:
    from pffs.torch.dcp import Reader as DcpReader
    from pffs.torch.dcp import Writer as DcpWriter

__all__ = ["DcpReader", "DcpWriter", "IterableDataset", "MapDataset", "PffsObject", "load", "save"]

_DCP = {"DcpReader": "Reader", "DcpWriter": "Writer"}


def __getattr__(name: str) -> Any:
    if name in _DCP:  # torch.distributed.checkpoint only when asked for
        from pffs.torch import dcp

        return getattr(dcp, _DCP[name])
    raise AttributeError(f"module 'pffs.torch' has no attribute {name!r}")
