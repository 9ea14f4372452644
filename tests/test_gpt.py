"""The GPT workload: offline, deterministic corpus and batches; the model; the quick benchmark on 2 nodes."""

import hashlib
import math

import pytest
import torch

from commhooks.tools import text
from commhooks.tools.bench import METHODS
from commhooks.tools.models import GPT
from tests.test_bench import bench

FIRST_BATCH_SHA256 = "949138ae82076082"  # seed 0, rank 0, batch 8 x 64 on CPython 3.11.7's text


def test_corpus_is_offline_and_identified_by_its_hash():
    corpus = text.load_corpus()
    assert corpus["sha256"] == text.SHA256_311, "the standard library differs from CPython 3.11.7's"
    assert len(corpus["train"]) > 800_000 and len(corpus["val"]) > 90_000
    assert text.load_corpus()["sha256"] == corpus["sha256"]  # read twice, the same text


def test_batches_are_deterministic_per_seed_step_and_rank():
    data = text.load_corpus()["train"]
    first = next(text.text_batches(data, 8, 64, rank=0, world=2, seed=0))[1]
    again = next(text.text_batches(data, 8, 64, rank=0, world=2, seed=0))[1]
    other = next(text.text_batches(data, 8, 64, rank=1, world=2, seed=0))[1]
    assert all(torch.equal(a, b) for a, b in zip(first, again)) and not torch.equal(first[0], other[0])
    x, y = first
    assert x.shape == y.shape == (8, 64) and torch.equal(x[:, 1:], y[:, :-1])  # y: the next byte
    digest = hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16]
    assert digest == FIRST_BATCH_SHA256, digest
    resumed = text.text_batches(data, 8, 64, rank=0, world=2, seed=0, start_step=5)
    straight = text.text_batches(data, 8, 64, rank=0, world=2, seed=0)
    for _ in range(5):
        next(straight)
    assert torch.equal(next(resumed)[1][0], next(straight)[1][0])  # a resumed run sees the same batches



def test_gpt_model_size_tied_head_and_causality():
    torch.manual_seed(0)
    model = GPT()
    n = sum(p.numel() for p in model.parameters())
    assert 2_000_000 <= n <= 10_000_000, n
    idx = torch.randint(0, 256, (2, 64))
    out = model(idx)
    assert out.shape == (2, 64, 256)
    changed = idx.clone()
    changed[:, 40] = (changed[:, 40] + 1) % 256
    assert torch.allclose(model(changed)[:, :40], out[:, :40], atol=1e-5)  # a position never sees the future
    out.sum().backward()
    assert model.tok.weight.grad is not None and model.tok.weight.grad.abs().sum() > 0
    with torch.no_grad():  # tied: the output head is the token embedding itself
        model.tok.weight.zero_()
        assert torch.equal(model(idx), torch.zeros_like(out))


def _quick_gpt_bench(methods, tmp_path):
    """The quick GPT bench (loopback), 4 ranks on 2 nodes: every method trains (below an untrained model's loss,
    ln 256 = 5.55), with every field a method has."""
    results, _, _ = bench(["--quick", "--model", "gpt", "--nodes", "2", "--ranks", "4", "--methods", ",".join(methods)],
                          tmp_path, timeout=400)
    assert set(results["methods"]) == set(methods)
    untrained = math.log(256)
    for name, m in results["methods"].items():
        assert {"val_loss", "val_ppl", "train_loss", "payload_bytes_per_rank", "step_ms", "config"} <= set(m)
        assert 0 < m["val_loss"] < untrained - 0.3 and m["step_ms"]["unlimited"] > 0, (name, m["val_loss"])
    assert results["setup"]["nodes"] == 2 and results["setup"]["network"] == "loopback", results["setup"]
    assert results["setup"]["model"] == "gpt" and "val loss" in (tmp_path / "table.md").read_text()
    assert set(METHODS) >= set(results["methods"])
    return results


@pytest.mark.xdist_group("gpt-bench")  # 4 ranks each: one after the other, not 8 ranks on 2 cores
def test_quick_gpt_bench_on_two_nodes(tmp_path):
    """"vs DDP" compares the bytes crossing the node links, as the full bench does (it compared every payload
    byte: qsr-int8-hier 1.157, more than DDP).  The bench's eight GPT methods run in two tests of four (this and
    the next), each under a minute; one after the other on one worker, each beside a lighter test."""
    from commhooks.tools.bench import compared_bytes

    results = _quick_gpt_bench(["ddp", "qsr", "qsr-int8-hier", "compute-only"], tmp_path)
    ddp, hier = (results["methods"][m] for m in ("ddp", "qsr-int8-hier"))
    assert hier["cross_node_payload_bytes_per_rank"] < hier["payload_bytes_per_rank"]  # some stays in the node
    assert 0 < compared_bytes(results, hier) / compared_bytes(results, ddp) < 0.5
    assert "vs DDP (cross-node)" in (tmp_path / "table.md").read_text()
    assert results["methods"]["qsr"]["config"]["h_base"] == 4  # the GPT config, not MNIST-1D's


@pytest.mark.xdist_group("gpt-bench")  # 4 ranks each: one after the other, not 8 ranks on 2 cores
def test_quick_gpt_bench_on_two_nodes_ab_powersgd_local_sgd(tmp_path):
    _quick_gpt_bench(["ab-groups", "ab-x-qsr", "powersgd-r4", "local-sgd-h8"], tmp_path)
