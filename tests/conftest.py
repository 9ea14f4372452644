import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests import torch_compat  # noqa: E402,F401 - the suite speaks torch 2.13 on every accepted torch
