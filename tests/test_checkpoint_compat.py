"""A checkpoint written by the last landed version loads in this one, and the run goes on exactly as it did.

tests/data/checkpoint-dc0baca/ holds per-rank checkpoints written by commit dc0baca on 2 gloo ranks (its
make.py, runnable again): QSR with an int8 payload, error feedback, outer momentum and one step of overlap,
saved with a sync in flight; AB saved inside an AB phase (its bases exist).  After the save, that version
trained ``AFTER`` more steps and recorded each rank's parameter checksums in expected.json.  Here today's
``commhooks.load_checkpoint`` loads them into a fresh run, which trains the same steps on the same data: the
checksums must be equal, bit for bit (CPU, one thread per rank, and make.PORTABLE_ENV on both sides: the steps
are deterministic, and the same on every x86-64 processor), except AB's, whose SVD rounds differently on another
processor vendor's LAPACK path: equal to 1e-6 there.
"""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from tests.dist import run_ranks

pytestmark = pytest.mark.xdist_group("checkpoint_compat")

DATA = Path(__file__).resolve().parent / "data" / "checkpoint-dc0baca"


def _make():
    """The generating script, as a module: the model, data, steps and checksum it wrote the checkpoints with."""
    spec = importlib.util.spec_from_file_location("checkpoint_dc0baca_make", DATA / "make.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _resume(rank, world, folder):
    import commhooks

    make = _make()
    out = {}
    for kind in make.CONFIGS:
        net, opt, sched, state = make.build(kind)
        ck = commhooks.load_checkpoint(Path(folder) / kind, net, opt, state, sched)
        loaded = {"step": ck["step"], "version": ck["version"], "state_step": state.step}
        if kind == "qsr":
            loaded["in_flight"] = bool(state.driver.in_flight)
        else:
            loaded["phase"], loaded["bases"] = state.phase, sorted(state.bases)
        make.train(net, opt, sched, ck["step"], make.AFTER, rank)
        out[kind] = {"loaded": loaded, "rank": rank, "saved": f"step-{ck['step']:08d}", **make.checksum(net)}
        state.finish()
    return out


def test_a_checkpoint_of_the_landed_version_loads_and_resumes_exactly(tmp_path, monkeypatch):
    expected = json.loads((DATA / "expected.json").read_text())
    make = _make()
    assert expected["configs"] == make.CONFIGS and expected["after"] == make.AFTER, "make.py changed: run it again"
    assert expected["env"] == make.PORTABLE_ENV, "make.py changed: run it again"
    for name, value in make.PORTABLE_ENV.items():  # the spawned ranks start with it, as make.py's did
        monkeypatch.setenv(name, value)
    for kind in make.CONFIGS:  # a copy: loading must not touch the data, but nothing may write there either
        shutil.copytree(DATA / kind, tmp_path / kind)
    runs = run_ranks(_resume, expected["world"], timeout=180, folder=str(tmp_path))
    for rank, out in enumerate(runs):
        for kind in make.CONFIGS:
            loaded = out[kind].pop("loaded")
            assert loaded["step"] == loaded["state_step"] == make.SAVE_AT[kind], (kind, loaded)
            assert loaded["version"] == expected["written_by"]["commhooks"], loaded
            if kind == "qsr":
                assert loaded["in_flight"], "the saved sync in flight was not restored"
            else:
                assert loaded["phase"] == "ab" and loaded["bases"], loaded
            want = expected["checksums"][kind][rank]
            if kind == "ab":  # AB re-bases by an SVD (LAPACK), which rounds differently across processor vendors
                # even under PORTABLE_ENV (an AMD EPYC with AVX-512: 2e-7 relative): the same run to 1e-6 there
                assert out[kind]["saved"] == want["saved"], (kind, rank, out[kind])
                for key in ("sum", "abs_sum"):
                    assert out[kind][key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), (kind, rank, out[kind])
            else:
                assert out[kind] == want, (kind, rank, out[kind])
