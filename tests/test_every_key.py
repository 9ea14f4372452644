"""Every key of every algorithm acts or is refused: a key a user sets and that changes nothing is a silent mistake.

The walk: for each registered algorithm, each key of its schema has an alternative value here (a new key without
one fails the walk).  On each base config (plain, and the bases that switch on the keys that depend on others),
the key changed to its alternative is either refused with a ConfigError naming it, or it acts: a short run on 4
real gloo ranks under DDP (12 steps, a small model with BatchNorm and low-rank weights, AdamW, a scheduler) ends
with other parameters, other bytes or other syncs than the base, or the algorithm's traffic declaration differs.
The keys that act on errors and logs, not on training, are listed apart with the test that shows each acting.
"""

import copy
import hashlib

import pytest
import torch

import commhooks
from commhooks import registry
from commhooks.config import load_config
from tests.dist import run_ranks

# keys that act on failures and logs, not on the training a short run shows, and where each is shown acting
OPERATIONAL = {
    "check_every": "tests/test_alignment.py (a divergence found at the N-th sync)",
    "nonfinite": "tests/test_reliability.py (raise or skip a NaN gradient)",
    "timeout_s": "tests/test_reliability.py (a hung collective fails within it)",
    "log_every": "tests/test_user_facing.py (rank 0's progress line)",
}

# per algorithm: the bases (name -> config) and each key's alternative value (key -> value), valid on every base
BASES = {
    "qsr": {
        "plain": {"type": "qsr", "h_base": 2, "alpha": 0.02, "warmup_steps": 2, "total_steps": 12},
        "streaming": {"type": "qsr", "h_base": 3, "alpha": 0.02, "warmup_steps": 2, "total_steps": 12,
                      "outer_lr": 0.8, "outer_momentum": 0.5, "payload": "int8", "error_feedback": True,
                      "overlap_steps": 1, "group_size": 2},
        "topk": {"type": "qsr", "h_base": 2, "payload": "topk", "topk_values": "int4", "error_feedback": True,
                 "outer_momentum": 0.5},
    },
    "ab": {
        "fixed": {"type": "ab", "warmup_steps": 2, "sync_period": 4, "full_rank_steps": 1, "group_size": 2,
                  "rank_cutoff": 0.3, "total_steps": 12},
        "rule": {"type": "ab", "warmup_steps": 2, "sync_period": 4, "full_rank_steps": 1, "group_size": 2,
                 "sync_rule": "qsr", "alpha": 0.02, "h_base": 3, "payload": "int8"},
    },
}
ALTERNATIVES = {
    "qsr": {"alpha": 0.03, "h_base": 3, "power": 1.0, "total_steps": 9, "init_h": 1, "warmup_steps": 4,
            "average_optimizer_state": True, "average_buffers": False, "group_size": 4, "outer_lr": 0.6,
            "outer_momentum": 0.3, "outer_nesterov": False, "outer_normalize": "lr_sum", "error_feedback": True,
            "error_feedback_decay": 0.5, "overlap_steps": 2, "overlap_merge": "mix", "overlap_alpha": 0.5,
            "overlap_schedule": "send-before",
            "fragments": 2, "hierarchical": True, "payload": "int4", "payload_block": 8,
            "payload_rounding": "stochastic", "topk_density": 0.5, "topk_chunk": 16, "topk_values": "int8",
            "payload_exchange": "allgather"},
    "ab": {"alpha": 0.04, "h_base": 8, "power": 1.0, "total_steps": 10, "warmup_steps": 3, "sync_period": 5,
           "full_rank_steps": 2, "rank_cutoff": 0.05, "group_size": 1, "mode": "only-b", "sync": "with-stale",
           "full_rank": ["0.*"], "min_compression_rate": 100.0, "truncate_first": True, "first_rank": "full",
           "rebound_steps": 3, "sync_rule": "qsr", "local_group_steps": True, "payload": "int4",
           "payload_block": 8, "payload_rounding": "stochastic", "topk_density": 0.5, "topk_chunk": 16,
           "topk_values": "int8", "payload_exchange": "allgather"},
}


def _model(seed: int = 0):
    """Low-rank weights (rank 2 plus a little noise), so AB finds layers worth compressing; a BatchNorm."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    with torch.no_grad():
        for layer in (model[0], model[3]):
            layer.weight.copy_(torch.randn(32, 2) @ torch.randn(2, 32) / 4 + 0.01 * torch.randn(32, 32))
    return model


def _short_run(rank, config: dict) -> tuple:
    """12 steps of DDP with ``config`` registered; (a digest of the parameters and buffers, bytes, syncs), or
    ("refused", message)."""
    try:
        load_config(config)
    except commhooks.ConfigError as exc:
        return ("refused", str(exc))
    model = torch.nn.parallel.DistributedDataParallel(_model(), broadcast_buffers=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    try:
        state = commhooks.ddp.register(model, optimizer, config)
    except commhooks.ConfigError as exc:
        return ("refused", str(exc))
    scheduler = state.wrap_scheduler(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / 24))
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(12):
        x = torch.randn(16, 32, generator=g)
        y = torch.randint(0, 8, (16,), generator=g)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        scheduler.step()
    state.finish()
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.module.state_dict().values()
                                     if t.is_floating_point())).hexdigest()[:16]
    result = (digest, state.meter.bytes(), state.syncs)
    state.remove()
    return result


def _walk(rank, world, cases):
    return {name: _short_run(rank, config) for name, config in cases.items()}


def _cases():
    cases = {}
    for algorithm, bases in BASES.items():
        for base_name, base in bases.items():
            cases[(algorithm, base_name, None)] = base
            for key, value in ALTERNATIVES[algorithm].items():
                if base.get(key) != value:
                    cases[(algorithm, base_name, key)] = {**copy.deepcopy(base), key: value}
    return cases


def test_every_key_of_every_algorithm_is_listed_with_an_alternative():
    # the algorithms commhooks ships (a test that registers its own, in the same worker, is not walked)
    for algorithm in (a for a in registry.algorithms() if a.config_class.__module__.startswith("commhooks.")):
        keys = set(algorithm.config_class.model_fields) - {"type"}
        listed = set(ALTERNATIVES.get(algorithm.name, {})) | set(OPERATIONAL)
        assert keys == listed, (f"{algorithm.name}: keys without an alternative here: {sorted(keys - listed)}; "
                                f"listed but gone: {sorted(listed - keys)}")


def test_every_key_acts_or_is_refused():
    cases = _cases()
    results = run_ranks(_walk, world_size=4, timeout=600, cases=cases)
    idle = []
    for (algorithm, base_name, key), config in cases.items():
        if key is None:
            continue
        mine = [r[(algorithm, base_name, key)] for r in results]
        base = [r[(algorithm, base_name, None)] for r in results]
        assert base[0][0] != "refused", (algorithm, base_name, base[0])
        if mine[0][0] == "refused":
            assert key in mine[0][1], (key, mine[0][1])  # the error names the key
            continue
        declared = [registry.for_config(load_config(c)).declare_traffic(load_config(c), _setting())
                    for c in (config, BASES[algorithm][base_name])]
        traffic_differs = declared[0] is not None and declared[1] is not None and \
            declared[0].by_tag() != declared[1].by_tag()
        if mine == base and not traffic_differs:
            idle.append(f"{algorithm} {base_name}: {key}={config[key]!r}")
    assert not idle, "accepted, yet changed nothing (refuse them, or make them act): " + "; ".join(idle)


def _setting():
    from commhooks.algorithms.traffic import Setting

    model = _model()
    return Setting.of([(n, tuple(p.shape)) for n, p in model.named_parameters()], world=4, steps=12,
                      lr=lambda s: 0.01 * (1.0 - s / 24), buffers=64, moments=2)


@pytest.mark.parametrize("config, words", [
    ({"type": "qsr", "overlap_alpha": 0.5}, "qsr.overlap_alpha 0.5 has no effect here: it acts only with "
                                            "overlap_steps > 0"),
    ({"type": "qsr", "topk_density": 0.02, "payload": "int8"}, "qsr.topk_density 0.02 has no effect here: it acts "
                                                               "only with payload topk"),
    ({"type": "qsr", "error_feedback": True}, "qsr.error_feedback True has no effect here: it acts only with a "
                                              "compressed payload"),
    ({"type": "ab", "alpha": 0.01}, "ab.alpha 0.01 has no effect here: it acts only with sync_rule 'qsr'"),
    ({"type": "ab", "mode": "only-b", "group_size": 2}, "ab.group_size 2 has no effect here: it acts only in mode "
                                                        "'groups'"),
])
def test_a_key_that_cannot_act_is_named_with_what_it_needs(config, words):
    with pytest.raises(commhooks.ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_config(config)
    ds = {"train_batch_size": 8, "comm_hook": {k: v for k, v in config.items()}}
    with pytest.raises(commhooks.ConfigError, match="comm_hook." + words.split(".", 1)[1].split(" ")[0]):
        load_config(ds)
