"""An Accelerate loop with commhooks, or the same loop on plain DDP with commhooks.ddp.register, 2 CPU ranks.

    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 tests/scripts/accelerate_run.py --out DIR --hook qsr
        [--plain] [--accum 2] [--steps N] [--save-at K] [--resume-from DIR] [--nan-at K] [--bf16] [--sgd]
        [--load-before-register [--unseen-load]]

Each rank writes DIR/rank<r>.json: its parameter checksum and first values, the hook's step and syncs, the error.
"""

import json
import os

import torch
from framework_common import configs, parser, tiny_gpt2

import commhooks

p = parser("--steps")
p.add_argument("--plain", action="store_true", help="torch DDP + commhooks.ddp.register instead of Accelerate")
p.add_argument("--save-at", type=int, default=0)
p.add_argument("--resume-from")
p.add_argument("--load-before-register", action="store_true", help="load_state right after prepare, as HF's examples")
p.add_argument("--save-every", type=int, default=0, help="save_state into one folder every K steps")
p.add_argument("--unseen-load", action="store_true",
               help="load_state as if commhooks.integrations.accelerate were imported after it (Accelerate's own)")
p.add_argument("--sgd", action="store_true", help="SGD without momentum: an optimizer that keeps no state")
args = p.parse_args()

CONFIGS = {**configs(total_steps=args.steps), "none": {"type": "none"}}  # none: Accelerate's DDP, metered


def batch(step, micro, rank):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank + 100000 * args.data_offset)
    return torch.randint(0, 64, (4, 16), generator=g)


model = tiny_gpt2()
if args.sgd:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0)
else:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
result = {}
if args.plain:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    commhooks.launch.init_distributed(backend="gloo")
    rank = dist.get_rank()
    net = DDP(model, broadcast_buffers=False)
    state = commhooks.ddp.register(net, optimizer, CONFIGS[args.hook])

    def train_step(step):
        optimizer.zero_grad()
        for m in range(args.accum):
            ids = batch(step, m, rank)
            if m < args.accum - 1:
                with net.no_sync():
                    (net(input_ids=ids, labels=ids).loss / args.accum).backward()
            else:
                (net(input_ids=ids, labels=ids).loss / args.accum).backward()
        optimizer.step()
else:
    from accelerate import Accelerator

    from commhooks.integrations import accelerate as integration

    accelerator = Accelerator(gradient_accumulation_steps=args.accum, mixed_precision="bf16" if args.bf16 else "no")
    rank = accelerator.process_index
    net, optimizer = accelerator.prepare(model, optimizer)
    state = None
    try:
        if args.resume_from and args.load_before_register:
            load = Accelerator.load_state.__wrapped__ if args.unseen_load else Accelerator.load_state
            load(accelerator, args.resume_from)
        state = integration.register(accelerator, net, optimizer, CONFIGS[args.hook])  # the line
    except Exception as exc:  # noqa: BLE001 - reported to the test (register restores after an early load_state)
        result["error"] = f"{type(exc).__name__}: {exc}"

    def train_step(step):
        for m in range(args.accum):
            with accelerator.accumulate(net):
                ids = batch(step, m, rank)
                loss = net(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                if args.nan_at == step and rank == 0 and m == args.accum - 1:
                    for param in net.parameters():
                        param.grad.fill_(float("nan"))
                optimizer.step()
                optimizer.zero_grad()

first = 0
try:
    if state is None:
        raise SystemExit  # the error is recorded already
    if not args.plain and args.resume_from and not args.load_before_register:
        accelerator.load_state(args.resume_from)
    first = getattr(state, "step", 0)
    with state:
        for step in range(first, args.steps):
            train_step(step)
            if not args.plain and (args.save_at and step + 1 == args.save_at
                                   or args.save_every and (step + 1) % args.save_every == 0):
                accelerator.save_state(os.path.join(args.out, "ckpt"))
except SystemExit:
    pass
except Exception as exc:  # noqa: BLE001 - reported to the test
    result["error"] = f"{type(exc).__name__}: {exc}"
result.update(rank=rank, checksum=float(sum(p.detach().double().sum() for p in model.parameters())),
              first=[float(v) for v in next(model.parameters()).detach().flatten()[:6]],
              step=getattr(state, "step", None), syncs=getattr(state, "syncs", None))
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fd:
    json.dump(result, fd)
