"""pffs.sdk: read datasets through the pffs cache from Python, without FUSE."""

from pffs.sdk.filesystem import PffsFileSystem, PffsReadFile
from pffs.sdk.helpers import open

__all__ = ["PffsFileSystem", "PffsReadFile", "open"]
