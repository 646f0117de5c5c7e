"""What the script builds that dptui does not record, said to dptui once (wire: `used`).

DistributedDataParallel: this process records DataParallel, not DDP (its ranks are recorded
when dptui launches them). dptui says so when the script ends, so that empty panels are never
the whole story. Watched where it is built, in torch's own `__init__`, so subclasses and every
name bound to the class count too.
"""

from __future__ import annotations

import functools
import threading

import torch.nn.parallel.distributed

from .link import ParentLink

DDP = "torch.nn.parallel.DistributedDataParallel"


def watch(link: ParentLink) -> None:
    """From now on, the first DistributedDataParallel built is said to dptui."""
    cls = torch.nn.parallel.distributed.DistributedDataParallel
    init = cls.__init__
    said = threading.Event()

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if not said.is_set():
            said.set()
            link.post({"type": "used", "what": DDP})
        init(self, *args, **kwargs)

    cls.__init__ = __init__
