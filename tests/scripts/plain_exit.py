"""A user's plain script: no commhooks.launch.shutdown(), no destroy_process_group(); run by tests/test_run_end.py
under torchrun many times: it must exit 0 every time (gloo's teardown aborted such scripts, rc 134, before the
library arranged its own).  END=open drops total_steps (the run ends between syncs: a warning at exit on every
rank), END=finish drops it too and calls state.finish() after the loop (no warning)."""
import inspect, os, torch, torch.distributed as dist, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
import commhooks
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
no_buffer_sync = {"forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters  # torch 2.13
                  else "broadcast_buffers": False}                                                  # torch 2.11
net = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)), **no_buffer_sync)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
conf = {"type": os.environ.get("ALGO", "ab"), "total_steps": 12}
if conf["type"] == "ab":
    conf.update(warmup_steps=2, sync_period=4, full_rank_steps=1, group_size=1, min_compression_rate=0.0)
else:
    conf.update(h_base=3, outer_lr=0.7, payload="int8", overlap_steps=1)
end = os.environ.get("END", "total")
if end != "total":
    del conf["total_steps"]
state = commhooks.ddp.register(net, opt, conf)
for step in range(12):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank), device="cpu")
    opt.zero_grad(); F.cross_entropy(net(x), x[:, :4].argmax(1)).backward(); opt.step()
if end == "finish":
    state.finish()
print("done", rank, state.syncs, flush=True)
