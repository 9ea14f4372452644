"""One suite for every torch that setup.cfg accepts (2.11 to 2.13).

The suite is written in torch 2.13's spelling.  Where an older torch spells a thing differently, this module
teaches it the new spelling, in the test processes only (the library handles both spellings itself; tested):

* DDP's ``forward_sync_buffers=`` (2.13) was ``broadcast_buffers=`` before.

Imported by tests/conftest.py and tests/dist.py, so the ranks a test spawns get it too.
"""

import inspect

from torch.nn.parallel import DistributedDataParallel

if "forward_sync_buffers" not in inspect.signature(DistributedDataParallel.__init__).parameters:
    _ddp_init = DistributedDataParallel.__init__

    def _init_with_the_new_spelling(self, *args, forward_sync_buffers=None, **kwargs):
        if forward_sync_buffers is not None:
            kwargs.setdefault("broadcast_buffers", forward_sync_buffers)
        _ddp_init(self, *args, **kwargs)

    DistributedDataParallel.__init__ = _init_with_the_new_spelling
