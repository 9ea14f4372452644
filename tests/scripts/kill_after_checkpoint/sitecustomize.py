"""A fault from outside the script: put this folder on ``PYTHONPATH`` and every Python process of the job imports
it at start-up (``site`` runs ``sitecustomize``), so a documented example runs unchanged and still loses a rank.

``KILL_RANK`` (a rank of torchrun's first attempt) SIGKILLs itself at optimizer step ``KILL_STEP``, once the
checkpoint folder ``$OUT/ckpt`` has a committed checkpoint (``latest``): "killed after its first checkpoint".
Every worker process notes its start in ``$OUT/attempts/rank<R>.attempt<N>`` (N: torchrun's restart count), so
a test sees how many times each rank was started.
"""

import os

if "RANK" in os.environ and "KILL_STEP" in os.environ and "OUT" in os.environ:
    _out = os.environ["OUT"]
    _rank, _attempt = os.environ["RANK"], os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    os.makedirs(os.path.join(_out, "attempts"), exist_ok=True)
    open(os.path.join(_out, "attempts", f"rank{_rank}.attempt{_attempt}"), "w").close()
    if _rank == os.environ.get("KILL_RANK", "1") and _attempt == "0":
        import signal
        import time

        from torch.optim.optimizer import register_optimizer_step_post_hook

        _steps = [0]

        def _kill_at_step(optimizer, args, kwargs):
            _steps[0] += 1
            if _steps[0] == int(os.environ["KILL_STEP"]):
                deadline = time.monotonic() + 60
                while not os.path.exists(os.path.join(_out, "ckpt", "latest")) and time.monotonic() < deadline:
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)

        register_optimizer_step_post_hook(_kill_at_step)
