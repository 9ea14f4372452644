"""Run a function on N real gloo ranks in fresh processes, with a hard timeout.

    results = run_ranks(worker, world_size=2, some_arg=1)

``worker(rank, world_size, **kwargs)`` runs after ``init_process_group("gloo")``
in a fresh process; its return value comes back (via ``torch.save``).  An
exception on any rank fails the test with that rank's traceback; a rank that
does not finish in ``timeout`` seconds gets every rank killed and the test
fails with "hang".  Workers must be module-level functions (spawn pickles them
by name).

Ranks are forked from a fork server that has imported torch and commhooks once (``forkserver`` with those
preloaded): a rank then starts in a fraction of a second instead of the 2-3 s an import of torch takes on
this machine, which over the suite's few hundred rank starts is minutes.  Each rank takes the parent's
environment as it is at ``run_ranks`` (the fork server's was fixed when it started).
``COMMHOOKS_TEST_START=spawn`` starts every rank from scratch instead.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch

from commhooks.launch import free_port
from tests import torch_compat  # noqa: F401 - the suite's torch spelling, in every rank

COLLECTIVE_TIMEOUT_S = 60
PRELOADED = ["torch", "torch.distributed", "commhooks", "commhooks.ddp", "tests.dist"]


def _context():
    method = os.environ.get("COMMHOOKS_TEST_START", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOADED)  # read when the server starts (the first call); later calls no-ops
    return ctx


def _entry(fn, rank, world, port, outdir, kwargs, env, backend, device_id, parent_env):
    os.environ.clear()
    os.environ.update(parent_env)  # the parent's environment now, not the fork server's at its start
    os.environ.update({  # a launcher's variables for one node; ``env`` may override any (nodes of fewer ranks)
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
        **(env(rank) if callable(env) else env)})
    torch.set_num_threads(1)
    import torch.distributed as dist

    out = Path(outdir) / f"rank{rank}.pt"
    try:
        init = {}
        if device_id is not None:  # eager NCCL: the communicator made at once, subgroups split from it
            torch.cuda.set_device(device_id)
            init["device_id"] = torch.device(device_id)
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S), **init
        )
        result = fn(rank, world, **kwargs)
        torch.save({"ok": True, "result": result}, out)
        try:  # a short, tolerant barrier: in fault tests a peer may be gone on purpose
            dist.barrier(async_op=True).wait(timeout=datetime.timedelta(seconds=10))
            dist.destroy_process_group()
        except Exception:
            os._exit(0)
    except BaseException as exc:  # report, never hang the parent
        torch.save(
            {"ok": False, "type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()},
            out,
        )
        os._exit(1)


class RankError(AssertionError):
    """A worker raised; ``errors`` holds each rank's record (type, message, traceback)."""

    def __init__(self, errors):
        self.errors = errors
        text = "\n".join(f"--- rank {r}: {e['type']}: {e['message']}\n{e['traceback']}" for r, e in errors.items())
        super().__init__(f"{len(errors)} rank(s) failed:\n{text}")


def run_ranks(fn, world_size: int = 2, timeout: float = 120.0, env=None, backend: str = "gloo",
              device_id=None, **kwargs):
    """Run ``fn`` on ``world_size`` ranks; return the list of their return values.  ``backend``: the process
    group's (``"cuda:gloo"``: several ranks on one GPU, refusing CPU tensors as NCCL does).  ``env``: a dict
    for every rank, or a function of the rank giving each its own (NCCL on one GPU: tests/gpu/common.py).
    ``device_id``: a CUDA device each rank binds and hands to ``init_process_group`` (eager NCCL)."""
    ctx = _context()
    port = free_port("127.0.0.1")
    with tempfile.TemporaryDirectory() as outdir:
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, port, outdir, kwargs, env or {}, backend, device_id,
                                              dict(os.environ)), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        records = {}
        for r in range(world_size):
            f = Path(outdir) / f"rank{r}.pt"
            if f.exists():
                records[r] = torch.load(f, weights_only=False)
        errors = {r: rec for r, rec in records.items() if not rec["ok"]}
        if errors:
            raise RankError(errors)
        if hung:
            raise TimeoutError(f"rank(s) {hung} did not finish within {timeout:.0f}s (hang?)")
        missing = [r for r in range(world_size) if r not in records]
        if missing:
            codes = {r: procs[r].exitcode for r in missing}
            raise AssertionError(f"rank(s) {missing} died without a result, exit codes {codes}")
        return [records[r]["result"] for r in range(world_size)]
