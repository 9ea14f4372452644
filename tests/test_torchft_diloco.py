"""commhooks against torchft's own DiLoCo: the six cases of torchft's DiLoCo regression test, replayed.

torchft 0.2.0 (the version commhooks pins) ships ``torchft/diloco_regression_test.py``: two replicas of a mock model
(two one-weight layers, one fragment each), a mock optimizer (``p -= lr * grad``; inner lr 1, outer lr 2), a fixed
gradient of 2, ``sync_every`` 6, ``fragment_sync_delay`` 0 or 1 and ``fragment_update_alpha`` 0, 0.5 or 1.  Here
torchft's own code runs each case (its ``mock_diloco_train_loop`` and ``Runner``, its Lighthouse, its DiLoCo: the
peer's classes, not a reference written from commhooks' docstrings) and records every step's weights and every
fragment's global copy; then commhooks runs the same model, optimizer and gradients on 2 gloo ranks with the config
the docs give for torchft's settings, and both records must agree at torchft's own tolerance (1e-5) at every step.

The config: ``{"type": "qsr", "h_base": 6, "fragments": 2, "outer_lr": 2, "outer_momentum": 0, "overlap_merge":
"mix", "overlap_alpha": alpha}`` and, with a delay, ``"overlap_steps": delay, "overlap_schedule": "send-before"``.
The default schedule, ``land-after`` (sent on the point, landing ``delay`` steps later), is another timeline: the
test shows it differs, so a one-step change of the schedule fails the comparison.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.dist import run_ranks

CASES = [(delay, alpha) for delay in (0, 1) for alpha in (0.0, 0.5, 1.0)]
SYNC_EVERY, FRAGMENTS, STEPS = 6, 2, 15


def _torchft(delay: int, alpha: float):
    """torchft's regression case ``(2 fragments, delay, alpha)`` run by torchft's own code, as its test runs it;
    replica 0's record: ``history`` (step -> name -> weights before that step) and ``global_parameter_history``."""
    from torchft._torchft import LighthouseServer  # the `torchft` extra; a missing install fails here
    from torchft.diloco_regression_test import MockModel, mock_diloco_train_loop
    from torchft.manager_integ_test import EventInjector, Runner

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    torch.manual_seed(42)
    state_dict = MockModel(in_dim=1, out_dim=1, n_layers=FRAGMENTS).state_dict()
    barrier = threading.Barrier(2)
    try:
        with ThreadPoolExecutor(max_workers=2) as executor:
            futures = [executor.submit(Runner(
                replica_id=replica, num_replicas=2, lighthouse_address=lighthouse.address(),
                event_injector=EventInjector(), train_loop=mock_diloco_train_loop,
                train_loop_args={"quorum_barrier": barrier, "n_fragments": FRAGMENTS, "model_state_dict": state_dict,
                                 "diloco_args": {"sync_every": SYNC_EVERY, "fragment_sync_delay": delay,
                                                 "fragment_update_alpha": alpha}}).run_replica)
                for replica in range(2)]
            results = [f.result(timeout=120) for f in futures]
    finally:
        lighthouse.shutdown()
    return results[0][0], results[1][0]


def config(delay: int, alpha: float, schedule: str = "send-before") -> dict:
    """The commhooks config the docs give for torchft's ``DiLoCo(sync_every=6, fragments of 2 layers,
    fragment_sync_delay=delay, fragment_update_alpha=alpha)`` with an SGD outer optimizer of lr 2."""
    c = {"type": "qsr", "h_base": SYNC_EVERY, "fragments": FRAGMENTS, "outer_lr": 2.0, "outer_momentum": 0.0,
         "overlap_merge": "mix", "overlap_alpha": alpha}
    return {**c, "overlap_steps": delay, "overlap_schedule": schedule} if delay else c


def _commhooks(rank, world, configs):
    """Each config on the mock model, optimizer and gradients of torchft's test (its own classes), no DDP: every
    step's weights (before the step) and each fragment's anchor (after ``step`` steps; step 0: the start)."""
    import commhooks
    from torchft.diloco_regression_test import MockModel, MockOptimizer

    out = {}
    for name, conf in configs.items():
        torch.manual_seed(42)
        model = MockModel(in_dim=1, out_dim=1, n_layers=FRAGMENTS)
        inner = MockOptimizer(model.parameters(), lr=1)
        state = commhooks.QSRState(inner, model=model, config=conf)
        history, anchors = {}, {0: {n: p.detach().clone().tolist() for n, p in model.named_parameters()}}
        for step in range(STEPS + 1):
            history[step] = {n: p.detach().clone().tolist() for n, p in model.named_parameters()}
            if step == STEPS:
                break
            for layer in model.layers:
                layer.weight.grad = torch.ones_like(layer.weight) * layer.weight_grad_value
            inner.step()
            if state.driver.anchored:
                anchors[step + 1] = {f"layers.{k}.weight": f.anchor.reshape(1, 1).tolist()
                                     for k, f in enumerate(state.driver.fragments)}
        out[name] = {"history": history, "global_parameter_history": anchors}
        state.remove()
    return out


@pytest.fixture(scope="module")
def ours():
    configs = {f"{d}-{a}": config(d, a) for d, a in CASES}
    configs.update({f"{d}-{a}-land-after": config(d, a, "land-after") for d, a in CASES if d})
    return run_ranks(_commhooks, 2, timeout=180, configs=configs)


def _agree(theirs: dict, mine: dict, key: str):
    """Every entry of torchft's record ``key`` (step -> name -> weights) against ours, at torchft's tolerance."""
    differ = []
    for step, params in theirs[key].items():
        for name, values in params.items():
            got = mine[key].get(int(step), {}).get(name)
            if got is None or not torch.allclose(torch.tensor(values), torch.tensor(got), rtol=1e-5, atol=1e-5):
                differ.append(f"{key} step {step} {name}: torchft {values}, commhooks {got}")
    return differ


@pytest.mark.parametrize("delay, alpha", CASES)
def test_torchft_diloco_regression_case_replayed_through_commhooks(ours, delay, alpha):
    """Every step's weights and every fragment's global copy, on both ranks, equal torchft's own run of the case
    (the outer step, the mix at every sync, and the send-before timeline)."""
    runs = _torchft(delay, alpha)
    assert len(runs[0]["history"]) == STEPS + 1, sorted(runs[0]["history"])  # torchft ran the 15 steps
    for rank, record in enumerate(ours):
        mine = record[f"{delay}-{alpha}"]
        differ = _agree(runs[rank], mine, "history") + _agree(runs[rank], mine, "global_parameter_history")
        assert not differ, "\n".join(differ[:8])
    if delay:  # the other timeline (sent on the point, landing later) is not torchft's: the comparison tells
        other = ours[0][f"{delay}-{alpha}-land-after"]
        assert _agree(runs[0], other, "history") + _agree(runs[0], other, "global_parameter_history"), \
            "land-after matched torchft's send-before: the test cannot tell"
