"""The library installs and works with torch alone: `pip install commhooks` (no extras) in a fresh venv,
and its shipped configs load by name from the installed (non-editable) package.

The trainer's and benchmark's dependencies (matplotlib, mnist1d, tqdm, numpy) belong to the
``tools`` extra; the hooks, the three adapters' DDP path and ``commhooks schema`` must not need them.
"""

import shutil
import subprocess
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import datetime, importlib.util, json, os, subprocess, sys
for absent in ("matplotlib", "mnist1d", "tqdm"):
    assert importlib.util.find_spec(absent) is None, absent + " is installed: the test needs a venv without it"
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import commhooks
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(commhooks.launch.free_port("127.0.0.1")))
dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
for config in ({"type": "qsr", "h_base": 2}, {"type": "ab", "mode": "only-b", "warmup_steps": 1, "sync_period": 3, "full_rank_steps": 1}):
    torch.manual_seed(0)
    net = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    state = commhooks.ddp.register(net, opt, config)
    for _ in range(4):
        opt.zero_grad()
        net(torch.randn(4, 8)).sum().backward()
        opt.step()
    assert state.step == 4 and state.syncs >= 1, (config, state)
dist.destroy_process_group()
schema = json.loads(subprocess.run([os.path.join(os.path.dirname(sys.executable), "commhooks"), "schema"],
                                   capture_output=True, text=True, check=True).stdout)
# shipped configs load by name from the installed package (not from a checkout: cwd is elsewhere)
from commhooks.config import load_config
assert not os.path.exists("configs") and load_config("qsr_mnist1d").kind == "qsr"
assert load_config("ds_qsr_bf16_zero2").group_size == 2
listing = subprocess.run([os.path.join(os.path.dirname(sys.executable), "commhooks"), "configs"],
                         capture_output=True, text=True, check=True).stdout
assert "ds_qsr_bf16_zero2" in listing and os.path.join("share", "commhooks", "configs") in listing, listing
print("OK", sorted(schema["discriminator"]["mapping"]))
'''


def test_library_installs_without_tool_dependencies(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "hooks", src / "hooks", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    shutil.copytree(REPO / "configs", src / "configs")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(f"torch=={__import__('torch').__version__.split('+')[0]}\n")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", str(constraints)]
    for what in ([f"torch=={__import__('torch').__version__.split('+')[0]}"], [str(src)]):
        proc = subprocess.run(pip + what, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = subprocess.run([py, "-c", SCRIPT], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                         env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "OK ['ab', 'qsr']" in run.stdout, run.stdout
