"""Property-based: random config dicts and JSON files fed to every entry point either work or raise
ConfigError, nothing else, and never hang. Runs in a real 1-rank gloo group (spawned, with a timeout)."""

import json
import tempfile
from pathlib import Path

from tests.dist import run_ranks

QSR_KEYS = ["alpha", "h_base", "init_h", "warmup_steps", "total_steps", "power", "average_optimizer_state",
            "average_buffers", "check_every", "nonfinite", "timeout_s"]
AB_KEYS = ["warmup_steps", "sync_period", "full_rank_steps", "rank_cutoff", "group_size", "mode", "sync", "full_rank",
           "min_compression_rate", "truncate_first", "rebound_steps", "sync_rule", "alpha", "h_base", "power",
           "total_steps", "local_group_steps", "check_every", "nonfinite", "timeout_s"]


def _fuzz(rank, world, examples):
    import torch
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commhooks
    import commhooks.deepspeed as ds_adapter
    from commhooks.config import ConfigError, load_config, to_dict

    values = st.one_of(
        st.none(), st.booleans(), st.integers(-3, 2000), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
        st.floats(0, 1), st.sampled_from(["qsr", "ab", "none", "groups", "only-b", "full", "with-stale", "fixed",
                                          "raise", "skip", "", "0.1"]),
        st.lists(st.sampled_from(["0.*", "2.weight", "nothing", "[", "*"]), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    )
    keys = st.sampled_from(sorted(set(QSR_KEYS + AB_KEYS)) + ["type", "lr", "x", "Alpha"])
    configs = st.dictionaries(keys, values, max_size=6).map(lambda d: d) | st.builds(
        lambda t, d: {"type": t, **d}, st.sampled_from(["qsr", "ab", "none", "bogus", 3]), st.dictionaries(keys, values, max_size=6))

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))

    entry_points = {
        "load_config(dict)": lambda c: load_config(c),
        "load_config(JSON file)": lambda c: load_config(write_json(c)),
        "DeepSpeed comm_hook section": lambda c: (ds_adapter.check_supported(ds := {"zero_optimization": {"stage": 0}, "comm_hook": c}),
                                                   load_config(ds)),
        "ddp.register": lambda c: commhooks.ddp.register(DDP(m := model()), torch.optim.SGD(m.parameters(), lr=0.1), c),
        "QSRState(config=)": lambda c: commhooks.QSRState(torch.optim.SGD(model().parameters(), lr=0.1), config={**c, "type": "qsr"}),
        "ABState(config=)": lambda c: commhooks.ABState(torch.optim.SGD((m := model()).parameters(), lr=0.1), model=m, config={**c, "type": "ab"}),
    }
    tmp = Path(tempfile.mkdtemp())

    def write_json(c):
        path = tmp / "c.json"
        path.write_text(json.dumps(c, default=str, allow_nan=True))
        return path

    outcomes = {name: {"ok": 0, "ConfigError": 0} for name in entry_points}
    outcomes["round trips"] = {"ok": 0, "ConfigError": 1}

    def round_trip(config):
        """Every accepted config survives to_dict -> JSON -> load_config unchanged."""
        try:
            conf = load_config(config)
        except ConfigError:
            return
        again = load_config(json.loads(json.dumps(to_dict(conf))))
        assert again == conf and to_dict(again) == to_dict(conf), (config, to_dict(conf))
        outcomes["round trips"]["ok"] += 1

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(configs)
    def check(config):
        round_trip(dict(config))
        for name, call in entry_points.items():
            try:
                call(dict(config))
                outcomes[name]["ok"] += 1
            except ConfigError:
                outcomes[name]["ConfigError"] += 1
            except Exception as exc:  # anything else is a bug
                raise AssertionError(f"{name} raised {type(exc).__name__}: {exc} for {config!r}") from exc

    check()
    return outcomes


def test_random_configs_work_or_raise_config_error():
    outcomes = run_ranks(_fuzz, 1, timeout=240, examples=300)[0]
    for name, counts in outcomes.items():
        assert counts["ConfigError"] > 0, (name, counts)  # the generator really produced bad input
    assert outcomes["ABState(config=)"]["ok"] > 0 or outcomes["QSRState(config=)"]["ok"] > 0, outcomes
    assert outcomes["round trips"]["ok"] > 0, outcomes
