"""A replica group whose config is its own (h_base from argv): tests/test_torchft.py starts two that differ.

    python tests/scripts/torchft_mismatch.py GROUP LIGHTHOUSE H_BASE
"""

import sys
import time
from datetime import timedelta

import torch
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo

import commhooks.torchft

group, lighthouse, h_base = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), load_state_dict=None, state_dict=None,
                  min_replica_size=1, use_async_quorum=False, timeout=timedelta(seconds=10),
                  quorum_timeout=timedelta(seconds=30), rank=0, world_size=1, store_addr="127.0.0.1",
                  store_port=store.port, lighthouse_addr=lighthouse, replica_id=f"group{group}")
try:
    live = commhooks.torchft.register(model, optimizer, {"type": "qsr", "h_base": h_base, "alpha": 0.0}, manager)
except commhooks.ConfigError as exc:
    print(f"group {group}: ConfigError: {exc}", flush=True)
    manager.shutdown(wait=False)
    sys.exit(3)
print(f"group {group}: joined", flush=True)
time.sleep(5)  # the other group may be healing from this one
manager.shutdown(wait=False)
