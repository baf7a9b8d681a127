"""PyTorch datasets and checkpoints over pffs (needs torch: `pip install 'pffs[torch]'`).

    from pffs.torch import IterableDataset, MapDataset, load, save

    train = MapDataset("s3://datasets/imagenet/train", transform=decode, endpoint_url="http://...")
    stream = IterableDataset("s3://datasets/shards", shuffle=True, seed=0, transform=decode)
    loader = torch.utils.data.DataLoader(stream, batch_size=64, num_workers=8)

An item is a `PffsObject` (a binary file over the object's bytes, with `.url` and `.key`) or what the
transform makes of it. Every process — each DataLoader worker, forked or spawned — reads through its own
pffs filesystem and the one disk cache of the machine. `import pffs` does not import torch; this does.
"""

try:
    import torch  # noqa: F401
except ImportError:
    raise ImportError("pffs.torch needs PyTorch: pip install 'pffs[torch]'") from None

from pffs.torch.checkpoints import load, save
from pffs.torch.datasets import IterableDataset, MapDataset
from pffs.torch.objects import PffsObject

__all__ = ["IterableDataset", "MapDataset", "PffsObject", "load", "save"]
