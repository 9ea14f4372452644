"""Host-device synchronisations per optimizer step, counted by CUDA itself (``torch.cuda.set_sync_debug_mode``
warns at every synchronising call; the warning names the Python line that made it): none from commhooks code
on a step that does not sync, in the default configs; the count at a sync is recorded.  In CPU mode the
count comes from tests/devicecheck.py's StrictDevices instead."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import commhooks
from tests.devicecheck import LIBRARY, TOOLS, StrictDevices
from tests.dist import run_ranks
from tests.gpu.common import TARGET, batch, ddp, local_device, model, rank_env, record
from tests.test_devices import CASES, _sync_marks


def _library_syncs(caught) -> int:
    n = 0
    for w in caught:
        path = Path(w.filename).resolve()
        if "synchroniz" in str(w.message) and LIBRARY in path.parents and TOOLS not in path.parents:
            n += 1
    return n


def _count(rank, world, cases):
    device = local_device()
    on_cuda = device.type == "cuda"
    out = {}
    mode = StrictDevices()
    for name, conf in cases.items():
        net = ddp(model(), device)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        state = commhooks.ddp.register(net, opt, conf)
        rows = []
        for step in range(12):
            x, y = batch(step, rank, device)
            before = _sync_marks(state)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if on_cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                with mode:
                    opt.zero_grad()
                    F.cross_entropy(net(x), y).backward()
                    opt.step()
                if on_cuda:
                    torch.cuda.set_sync_debug_mode("default")
            reads = _library_syncs(caught) if on_cuda else mode.take()[0]
            mode.take()
            rows.append((reads, _sync_marks(state) != before))
        out[name] = rows
    return out


def test_no_host_sync_from_commhooks_on_steps_that_do_not_sync():
    results = run_ranks(_count, 2, timeout=240, backend=TARGET.backend, env=rank_env, device_id=TARGET.device_id,
                        cases=CASES)
    figures = {}
    for case, rows in results[0].items():
        # the first step is set-up: an outer step's anchor asks, once, whether the ranks start equal (a host read).
        # (The NaN guard's index of the parameters with gradients, a host-to-device copy CUDA counts, is made
        # only when some parameter has none: not in these cases.)
        first, rows = rows[0], rows[1:]
        assert first[1] or first[0] <= 1, (case, first)
        quiet = [reads for reads, synced in rows if not synced]
        assert quiet and all(r == 0 for r in quiet), (case, rows)
        figures[case] = {"first_step": first[0], "non_sync_steps": len(quiet),
                         "at_syncs": sorted({r for r, s in rows if s})}
    record("host syncs per step (commhooks code)", figures)
