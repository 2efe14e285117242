"""Building the DataLoader a setting names: the factory, batched fetch, thread workers.

Modules, from the top down, one job each::

    _factory         build_loader(): a DataLoader or ThreadLoader from a setting
    _draws           a tuned loader drawing from the RNGs as the user's own would
                     (NOTE [ A tuned loader's draws ]), for the framework adapters
    _feed            an epoch's batches handed out once each, to loaders that take turns
                     (NOTE [ Every batch once ]), for AutoLoader
    _batch_items     BatchItems: a per-item sampler over a batch sampler's batches
    _batched         a whole batch fetched with one indexing (NOTE [ Batched fetch ])
    _thread_loader   ThreadLoader: a DataLoader whose workers are threads
    _worker_threads  LimitThreads: native thread pools held to one thread per worker
    _worker_process  what forked workers take from their process: its temporary
                     directory, and a parent they exit without
    _step_threads    step_threads(): the training process's own torch threads, for a
                     block (NOTE [ Step threads ])
    _params          the settings autoloader tunes, in their canonical form
    _dataloader_options
                     DataLoader's own arguments and defaults, read from its signature,
                     that AutoLoader's and ThreadLoader's are checked against
    _torch_compat    every private torch API autoloader touches, in one place

``_torch_compat`` is not re-exported: ``loader`` and ``measure`` import it by its name,
so that every use of torch's private API is found by searching for that name.
"""

from autoloader.loader._batch_items import BatchItems
from autoloader.loader._batched import PER_ITEM_OPTIONS
from autoloader.loader._dataloader_options import DATALOADER_DEFAULTS, changed_options
from autoloader.loader._draws import drawing_as, persistent
from autoloader.loader._factory import (
    build_loader,
    dataloader_kwargs,
    default_start_method,
    merge_loader_kwargs,
    new_loader,
)
from autoloader.loader._feed import EpochBatches, Feed, handing_out
from autoloader.loader._params import (
    BASELINE_PARAMS,
    TUNED_KEYS,
    WORKER_KINDS,
    Params,
    normalize_params,
)
from autoloader.loader._step_threads import kept_threads, set_step_threads, step_threads
from autoloader.loader._thread_loader import THREAD_WORKER_PREFIX, ThreadLoader
from autoloader.loader._worker_process import start_method

__all__ = [
    "BASELINE_PARAMS",
    "DATALOADER_DEFAULTS",
    "PER_ITEM_OPTIONS",
    "THREAD_WORKER_PREFIX",
    "TUNED_KEYS",
    "WORKER_KINDS",
    "BatchItems",
    "EpochBatches",
    "Feed",
    "Params",
    "ThreadLoader",
    "build_loader",
    "changed_options",
    "dataloader_kwargs",
    "default_start_method",
    "drawing_as",
    "handing_out",
    "kept_threads",
    "merge_loader_kwargs",
    "new_loader",
    "normalize_params",
    "persistent",
    "set_step_threads",
    "start_method",
    "step_threads",
]
