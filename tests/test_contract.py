"""The algorithm contract: a registry, declarative configs, generated docs, and layers that hold.

The third algorithm lives in tests/scripts/toy_algorithm.py and is registered through the public
API only; here it runs under DDP (the Horovod and DeepSpeed scripts run it too, see
test_horovod.check_toy).
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks import config, registry
from commhooks.algorithms.contract import STEP_PROOF_BYTES
from commhooks.algorithms.traffic import Send, Setting
from commhooks.config import ConfigError, load_config, to_dict
from tests.dist import run_ranks

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "hooks" / "commhooks"
sys.path.insert(0, str(REPO / "tests" / "scripts"))
from toy_algorithm import TOY, MeanEveryStepConfig, MeanEveryStepState  # noqa: E402


def test_registry_knows_the_toy_and_refuses_a_clash():
    assert registry.names()[:2] == ["qsr", "ab"] and "mean-every-step" in registry.names()
    assert registry.get("mean-every-step").state_class is MeanEveryStepState
    assert isinstance(load_config(TOY), MeanEveryStepConfig)
    assert load_config(to_dict(load_config(TOY))) == load_config(TOY)
    with pytest.raises(ConfigError, match=r"mean-every-step\.period must be >= 1, got 0"):
        load_config({"type": "mean-every-step", "period": 0})
    with pytest.raises(ConfigError, match=r"config\.type must be one of 'none', 'qsr', 'ab', 'mean-every-step'"):
        load_config({"type": "mean-every-stp"})
    declared = registry.get("mean-every-step").traffic
    commhooks.register_algorithm(MeanEveryStepConfig, MeanEveryStepState)  # the same pair again: a no-op
    assert registry.get("mean-every-step").traffic is declared  # (its traffic declaration kept)
    with pytest.raises(TypeError, match="traffic must be"):
        commhooks.register_algorithm(MeanEveryStepConfig, MeanEveryStepState, traffic=3)

    class Other(MeanEveryStepState):
        pass

    with pytest.raises(ValueError, match="already registered"):
        commhooks.register_algorithm(MeanEveryStepConfig, Other)
    with pytest.raises(TypeError, match="HookConfig subclass"):
        commhooks.register_algorithm(dict, Other)


def _toy_under_ddp(rank, world, steps):  # the toy is registered by this module's import of toy_algorithm
    def train(hook):
        torch.manual_seed(0)
        net = DDP(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)))
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        state = commhooks.ddp.register(net, opt, hook) if hook else None
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            opt.zero_grad()
            F.cross_entropy(net(torch.randn(8, 6, generator=g)), torch.randint(0, 3, (8,), generator=g)).backward()
            opt.step()
        return [p.detach().clone() for p in net.parameters()], state

    plain, _ = train(None)
    toy, state = train(TOY)
    return plain, toy, state.step, state.syncs, state.meter.by_tag(), state.report()


def test_toy_algorithm_runs_under_ddp_with_no_adapter_change():
    for plain, toy, step, syncs, tags, report in run_ranks(_toy_under_ddp, 2, steps=7):
        numel = sum(t.numel() for t in plain)
        for a, b in zip(plain, toy):
            assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()
        assert (step, syncs) == (7, 2)
        traffic = registry.declared_traffic(load_config(TOY), Setting.of([(str(i), t.shape) for i, t in
                                                                          enumerate(plain)], steps=7))
        assert tags == traffic.by_tag() and traffic.sync_steps == [3, 6]  # the meter counts what the toy declares
        assert traffic.sync == (Send("allreduce", 4 * numel + STEP_PROOF_BYTES, "sync"),)
        assert report["algorithm"] == "mean-every-step" and report["syncs"] == 2


def test_json_schema_is_a_discriminated_union_of_the_registered_configs():
    schema = config.json_schema()
    assert set(schema["discriminator"]["mapping"]) >= {"qsr", "ab", "mean-every-step"}
    out = subprocess.run([sys.executable, "-m", "commhooks.cli", "schema"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)  # a fresh process: only the built-ins
    assert set(printed["discriminator"]["mapping"]) == {"qsr", "ab"}
    qsr = printed["$defs"]["QSRConfig"]["properties"]
    assert qsr["h_base"]["minimum"] == 1 and printed["$defs"]["QSRConfig"]["additionalProperties"] is False


def test_docs_key_tables_match_the_config_classes():
    reference = REPO / "docs" / "pages" / "reference" / "config.md"
    text = reference.read_text()
    for kind in ("qsr", "ab"):
        assert config.TABLE_BEGIN.format(kind=kind) in text, f"{reference} has no generated key table for {kind}"
    assert config.update_tables(text) == text, f"the key tables are stale: run `commhooks schema --readme {reference}`"
    out = subprocess.run([sys.executable, "-m", "commhooks.cli", "schema", "--readme", str(reference), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_readme_check_fails_on_a_stale_table(tmp_path):
    stale = tmp_path / "README.md"
    begin = config.TABLE_BEGIN.format(kind="qsr")
    stale.write_text(f"# x\n\n{begin}\n| key | old |\n{config.TABLE_END}\n")
    check = [sys.executable, "-m", "commhooks.cli", "schema", "--readme", str(stale), "--check"]
    assert subprocess.run(check, capture_output=True, text=True, timeout=60).returncode == 1
    subprocess.run(check[:-1], check=True, capture_output=True, timeout=60)
    assert "| `h_base` |" in stale.read_text()
    assert subprocess.run(check, capture_output=True, text=True, timeout=60).returncode == 0


# --------------------------------------------------------------------------
# layers: checked on the source, so a new import that breaks them fails here
# --------------------------------------------------------------------------


def _modules(folder):
    return sorted(p for p in folder.rglob("*.py"))


def test_algorithms_import_no_engine_and_read_no_environment():
    for path in _modules(PKG / "algorithms"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
                for name in names:
                    root = name.split(".")[0]
                    assert root not in ("os", "horovod", "deepspeed", "mpi4py"), (path.name, name)
                    assert "parallel" not in name and "distributed" not in name, (path.name, name)
                if isinstance(node, ast.ImportFrom) and node.level:
                    assert node.module is None or node.module.split(".")[0] not in ("ddp", "horovod", "deepspeed", "launch", "tools"), (path.name, node.module)
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("environ", "getenv", "broadcast_buffers", "forward_sync_buffers"), (path.name, node.attr)


def test_adapters_and_tools_name_no_algorithm():
    """Adapters and tools dispatch through the registry; the benchmark's method labels (display names that
    point at config files) are the one place an algorithm's name may appear as a string."""
    files = [PKG / "ddp.py", PKG / "horovod.py", *_modules(PKG / "deepspeed"), PKG / "facts.py", PKG / "launch_horovod.py",
             PKG / "tools" / "train.py", PKG / "tools" / "bench.py"]
    algorithm_names = {"QSRState", "ABState", "QSRConfig", "ABConfig", "LRRebound", "qsr_hook", "ab_hook"}
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and path.name != "bench.py":
                assert node.value not in ("qsr", "ab"), (path.name, node.value, node.lineno)
            if isinstance(node, ast.Name):
                assert node.id not in algorithm_names, (path.name, node.id, node.lineno)
            if isinstance(node, ast.Attribute):
                assert node.attr not in algorithm_names | {"rebound_steps"}, (path.name, node.attr, node.lineno)


def test_importing_the_deepspeed_adapter_changes_no_environment():
    code = "import os; before = dict(os.environ); import commhooks.deepspeed; assert dict(os.environ) == before; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
