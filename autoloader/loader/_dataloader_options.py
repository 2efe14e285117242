"""DataLoader's own arguments and their defaults, read from its signature once.

``AutoLoader`` and :class:`~autoloader.loader._thread_loader.ThreadLoader` take
DataLoader's arguments as DataLoader does, each with a signature of its own written out
(what users and their IDEs read). This is the list they are checked against
(``tests/test_signatures.py``: the same names, kinds and defaults, in DataLoader's
order), so that a torch release that adds an argument fails a test rather than being
refused, and what tells the options a user changed from the ones left to DataLoader.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch.utils.data import DataLoader

# Each argument of DataLoader after ``dataset``, with its default, in DataLoader's order
# (torch 2.6 to 2.13: batch_size ... generator, then the keyword-only prefetch_factor,
# persistent_workers, pin_memory_device and in_order).
DATALOADER_DEFAULTS: Mapping[str, Any] = {
    name: parameter.default
    for name, parameter in inspect.signature(DataLoader.__init__).parameters.items()
    if parameter.default is not inspect.Parameter.empty
}


def changed_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The DataLoader options in ``options`` (name to value) whose value is not
    DataLoader's default, in their order.

    Raises:
        KeyError: a name that is not one of DataLoader's arguments.
    """
    return {
        name: value
        for name, value in options.items()
        if value is not (default := DATALOADER_DEFAULTS[name]) and value != default
    }
