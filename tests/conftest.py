import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
# DeepSpeed's CPU ops, built once by `make install` (.ci/install.sh) into the clone's cache: every test and every
# process it starts finds them there.  Left to its default (~/.cache/torch_extensions), DeepSpeed rebuilt them
# for each clone (the sources' paths are part of the build) while the tests waited on its lock.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"))

from tests import torch_compat  # noqa: E402,F401 - the suite speaks torch 2.13 on every accepted torch
