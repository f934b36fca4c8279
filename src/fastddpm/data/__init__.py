"""fastddpm.data: turn any image source into a uint8 (N, C, H, W) cache, decoded exactly once.

    from fastddpm.data import prepare
    data = prepare("fashion-mnist")          # or a folder, a .zip, cifar-10-python.tar.gz, an .npz ...
    data.images   # uint8 (N, C, H, W) np.memmap: training reads pages, never decodes a PNG
    data.labels   # int64 (N,), -1 where the source has no labels

Module map: sources (what SOURCE is) -> idx / cifar / arrays / imagefolder (readers) -> images
(safe decode of one file) -> decode (rows into the cache) -> cache (atomic build, reuse) ;
named (downloads), prepare (the entry points), summary (info text), cli (`fastddpm data ...`).
"""

from fastddpm.data.cache import PreparedData, default_cache_dir
from fastddpm.data.errors import DataError
from fastddpm.data.named import NAMED_DATASETS
from fastddpm.data.prepare import info, prepare
from fastddpm.data.summary import describe

__all__ = ["DataError", "NAMED_DATASETS", "PreparedData", "default_cache_dir", "describe", "info", "prepare"]
