"""commhooks inside the trainers people use, with the real packages: Hugging Face Accelerate and Trainer, PyTorch
Lightning (2 gloo ranks under torchrun, a 2-layer GPT-2 built from a config, synthetic tokens).

For each: QSR and AB, gradient accumulation 1 and 2, bf16 where the CPU allows; the ranks end identical; a resume
from the framework's own checkpoint is bit-exact, and one without commhooks' per-rank state is refused on every
rank; a NaN injected at step k is named at step k on every rank.  Accelerate against the same loop on plain DDP
(`commhooks.ddp.register`): equal.  The Trainer with a DeepSpeed bf16 ZeRO-2 config whose `comm_hook` section
QSR reads (no wrapper of the user's): identical ranks and an exact resume.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"


def torchrun_runs(script: str, runs, env=None, timeout: int = 600):
    """Several runs of ``script`` in one launch (tests/scripts/several.py): ``runs`` maps a name to
    ``(out, args...)``; the result maps each name to its ranks' records (read from ``--report`` if a run gives
    one, else from ``out``).  The imports are most of a launch here (about 4 of its 5 s of CPU per rank), so the
    runs of a module share a launch or two: the 24 launches of Accelerate's, the Trainer's and Lightning's tests
    became 7."""
    reports, argv = {}, []
    for name, (out, *args) in runs.items():
        reports[name] = Path(args[args.index("--report") + 1]) if "--report" in args else out
        for folder in {out, reports[name]}:
            folder.mkdir(parents=True, exist_ok=True)
        argv.append(["--out", str(out), *args])
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(SCRIPTS / "several.py"), script, json.dumps(argv)], cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True, timeout=timeout)
    results = {}
    for (name, (_, *args)), report in zip(runs.items(), reports.values()):
        results[name] = []
        for r in range(2):
            f = report / f"rank{r}.json"
            assert f.exists(), (f"{script} {name} {args}: rank {r} wrote nothing (rc {proc.returncode}):\n"
                                + proc.stderr[-3000:])
            results[name].append(json.loads(f.read_text()))
    return results


def torchrun(script: str, out: Path, *args: str, env=None):
    """One run of ``script`` in a launch of its own: its ranks' records."""
    return torchrun_runs(script, {"run": (out, *args)}, env)["run"]


def identical(ranks, steps):
    a, b = ranks
    assert "error" not in a and "error" not in b, (a.get("error"), b.get("error"))
    assert a["checksum"] == b["checksum"] and a["step"] == b["step"] == steps and a["syncs"] >= 2, (a, b)
    return a["checksum"]


def refused_everywhere(ranks, framework):
    for r in ranks:
        assert r.get("error", "").startswith("CheckpointError: " + framework + ": resuming"), r
        assert "lacks the per-rank state commhooks keeps" in r["error"], r["error"]


def nan_named_everywhere(ranks, step):
    """``step``: the loop's (or the trainer's ``global_step``'s) count from 0 where rank 0's gradients became NaN:
    the error numbers optimizer steps from 1."""
    for r in ranks:
        assert r.get("error", "").startswith("NonFiniteError: NaN or Inf gradient on 1 of 2 ranks since the last "
                                             "sync, found at the "), r
    assert f"at optimizer step {step + 1} on rank 0 in:" in ranks[0]["error"], ranks[0]["error"]
    assert "none on this rank (1)" in ranks[1]["error"], ranks[1]["error"]


def without_commhooks_state(checkpoint: Path, to: Path) -> None:
    shutil.copytree(checkpoint, to)
    shutil.rmtree(to / "commhooks")


# --------------------------------------------------------------------------
# Accelerate
# --------------------------------------------------------------------------

CPU = {"ACCELERATE_USE_CPU": "1"}


@pytest.fixture(scope="module")
def accelerate_runs(tmp_path_factory):
    """Every Accelerate run of this module, in two launches: AB with accumulation 2 saved at step 6, the same on
    other data, and QSR with SGD without momentum saved at step 6; then, from their checkpoints, the plain DDP loop,
    the resumes (bit-exact, foreign, bare, and loads commhooks did not see), QSR in bf16, a NaN and Accelerate's own
    DDP."""
    root = tmp_path_factory.mktemp("accelerate")
    ab = ("--hook", "ab", "--accum", "2")
    sgd = ("--hook", "qsr", "--sgd")  # an optimizer whose state dict holds no state
    runs = torchrun_runs("accelerate_run.py", {"ab": (root / "ab", *ab, "--save-at", "6"),
                                              "other": (root / "other", *ab, "--save-at", "6", "--data-offset", "1"),
                                              "sgd": (root / "sgd", *sgd, "--save-at", "6")},
                         env=CPU)
    # the folder holding another run's per-rank state of the same step (copied by hand), and one without any
    without_commhooks_state(root / "ab" / "ckpt", root / "foreign")
    shutil.copytree(root / "other" / "ckpt" / "commhooks", root / "foreign" / "commhooks")
    without_commhooks_state(root / "ab" / "ckpt", root / "bare")
    runs.update(torchrun_runs("accelerate_run.py", {
        "plain": (root / "plain", *ab, "--plain"),
        # accelerator.load_state right after prepare, before register (where Hugging Face's examples put it)
        "resumed": (root / "resumed", *ab, "--resume-from", str(root / "ab" / "ckpt"), "--load-before-register"),
        "foreign": (root / "foreign-run", *ab, "--resume-from", str(root / "foreign"), "--load-before-register"),
        "refused": (root / "refused", *ab, "--resume-from", str(root / "bare")),
        "sgd-resumed": (root / "sgd-resumed", *sgd, "--resume-from", str(root / "sgd" / "ckpt"),
                        "--load-before-register"),
        # load_state before commhooks.integrations.accelerate was imported: the folder it read is unknown
        "sgd-unseen": (root / "sgd-unseen", *sgd, "--resume-from", str(root / "sgd" / "ckpt"),
                       "--load-before-register", "--unseen-load"),
        "adamw-unseen": (root / "adamw-unseen", *ab, "--resume-from", str(root / "ab" / "ckpt"),
                         "--load-before-register", "--unseen-load"),
        "qsr": (root / "qsr", "--hook", "qsr", "--bf16", "--save-every", "3"),
        "nan": (root / "nan", "--hook", "qsr", "--nan-at", "4"),
        # {"type": "none"}: the same loop (with state:, save_state) on Accelerate's own DDP
        "none": (root / "none", "--hook", "none", "--steps", "4", "--save-at", "2")}, env=CPU))
    return root, runs


@pytest.mark.xdist_group("accelerate")
def test_accelerate_is_the_plain_ddp_loop_and_resumes_bit_exact(accelerate_runs):
    _, runs = accelerate_runs
    assert identical(runs["ab"], 12) == identical(runs["plain"], 12)  # the Accelerate loop is the plain DDP loop
    assert identical(runs["resumed"], 12) == identical(runs["ab"], 12)  # bit-exact from accelerator.load_state


@pytest.mark.xdist_group("accelerate")
def test_accelerate_refuses_a_foreign_or_missing_per_rank_state(accelerate_runs):
    _, runs = accelerate_runs
    assert "error" not in runs["other"][0], runs["other"][0]
    foreign_everywhere(runs["foreign"], "Accelerate")  # another run's per-rank state: refused, naming both
    refused_everywhere(runs["refused"], "Accelerate")


@pytest.mark.xdist_group("accelerate")
def test_accelerate_refuses_a_load_state_it_did_not_see_even_with_a_stateless_optimizer(accelerate_runs):
    """load_state before the module's import: refused on every rank, naming the fix, with SGD without momentum
    (whose state dict holds nothing: it used to restart the hook at step 0 silently) as with AdamW; the same load
    seen resumes SGD bit-exact."""
    _, runs = accelerate_runs
    assert identical(runs["sgd-resumed"], 12) == identical(runs["sgd"], 12)
    for name in ("sgd-unseen", "adamw-unseen"):
        for r in runs[name]:
            said = r.get("error", "")
            assert said.startswith("ConfigError: commhooks.integrations.accelerate.register: the optimizer comes "
                                   "from a commhooks checkpoint (the hook at step 6 there)"), (name, r)
            assert "Import commhooks.integrations.accelerate at the top of the script, before load_state" in said


@pytest.mark.xdist_group("accelerate")
def test_accelerate_qsr_bf16_keeps_the_newest_per_rank_checkpoint(accelerate_runs):
    root, runs = accelerate_runs
    identical(runs["qsr"], 12)  # saved into one folder 4 times: one per-rank checkpoint there, the newest
    assert per_rank_steps(root / "qsr" / "ckpt") == ["commhooks/step-00000012"]


@pytest.mark.xdist_group("accelerate")
def test_accelerate_names_a_nan_and_runs_its_own_ddp_metered(accelerate_runs):
    _, runs = accelerate_runs
    nan_named_everywhere(runs["nan"], 4)
    none = runs["none"]
    assert "error" not in none[0] and "error" not in none[1] and none[0]["checksum"] == none[1]["checksum"], none


# --------------------------------------------------------------------------
# Hugging Face Trainer
# --------------------------------------------------------------------------


def foreign_everywhere(ranks, framework):
    for r in ranks:
        assert r.get("error", "").startswith("CheckpointError: " + framework + ": the per-rank state in"), r
        assert "saved beside other weights" in r["error"] and "another run or another checkpoint" in r["error"], r


def per_rank_steps(root: Path) -> list:
    """The per-rank checkpoints under ``root`` (every commhooks/**/step-N folder), as relative paths."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("step-*") if p.is_dir() and "commhooks" in p.parts)


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """Every Trainer run of this module but DeepSpeed's, in two launches: QSR saving every 6 steps (run A) and on
    other data (run B); then the resumes from their checkpoints (bit-exact, foreign, bare), AB in bf16 keeping one
    checkpoint, and a NaN."""
    root = tmp_path_factory.mktemp("trainer")
    a_dir, b_dir = root / "a", root / "b"
    qsr = ("--hook", "qsr")
    runs = torchrun_runs("hf_trainer.py", {"a": (a_dir, *qsr, "--save-steps", "6"),
                                          "b": (b_dir, *qsr, "--save-steps", "6", "--data-offset", "100")}, env=CPU)
    # B's checkpoint holding A's per-rank state (folders copied by hand), and A's without any
    foreign = root / "foreign" / "checkpoint-6"
    without_commhooks_state(b_dir / "checkpoint-6", foreign)
    shutil.copytree(a_dir / "checkpoint-6" / "commhooks", foreign / "commhooks")
    bare = root / "bare"
    bare.mkdir()
    without_commhooks_state(a_dir / "checkpoint-6", bare / "checkpoint-6")
    runs.update(torchrun_runs("hf_trainer.py", {
        # resume_from_checkpoint=PATH with another output_dir: the per-rank state comes from PATH, not output_dir
        "resumed": (root / "elsewhere", *qsr, "--save-steps", "6", "--resume-from", str(a_dir / "checkpoint-6")),
        # run B (other data) resumed while its output_dir holds run A's checkpoint-6: B's own state, exactly
        "b_in_a": (root / "a-again", *qsr, "--data-offset", "100", "--resume-from", str(b_dir / "checkpoint-6")),
        "foreign": (root / "foreign-run", *qsr, "--data-offset", "100", "--resume-from", str(foreign)),
        "bare": (bare, *qsr, "--save-steps", "6", "--resume"),
        # save_total_limit=1: the Trainer keeps one checkpoint, and the per-rank state inside it goes with the others
        "ab": (root / "ab", "--hook", "ab", "--accum", "2", "--bf16", "--save-steps", "4", "--save-total-limit", "1"),
        "nan": (root / "nan", *qsr, "--accum", "2", "--nan-at", "5")}, env=CPU))
    return root, runs


@pytest.mark.xdist_group("trainer")
def test_transformers_trainer_resumes_bit_exact_from_the_named_checkpoint(trainer_runs):
    _, runs = trainer_runs
    straight, straight_b = identical(runs["a"], 12), identical(runs["b"], 12)
    assert runs["a"][0]["warmup"] == 4 and runs["a"][0]["total"] == 12, runs["a"][0]  # from the Trainer's arguments
    assert straight_b != straight
    assert identical(runs["resumed"], 12) == straight  # bit-exact from the Trainer's own checkpoint
    assert identical(runs["b_in_a"], 12) == straight_b


@pytest.mark.xdist_group("trainer")
def test_transformers_trainer_refuses_a_foreign_or_missing_per_rank_state(trainer_runs):
    _, runs = trainer_runs
    foreign_everywhere(runs["foreign"], "Trainer")  # refused on every rank, naming both
    refused_everywhere(runs["bare"], "Trainer")


@pytest.mark.xdist_group("trainer")
def test_transformers_trainer_ab_bf16_keeps_one_checkpoint_and_names_a_nan(trainer_runs):
    root, runs = trainer_runs
    identical(runs["ab"], 12)
    assert per_rank_steps(root / "ab") == ["checkpoint-12/commhooks/step-00000012"]
    nan_named_everywhere(runs["nan"], 5)


def test_transformers_trainer_with_deepspeed_bf16_zero2(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({
        "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
        "comm_hook": {"type": "qsr", "h_base": 3, "alpha": 0.002, "group_size": 1}}))  # the rule: its warm-up acts
    first = torchrun("hf_trainer.py", tmp_path / "run", "--deepspeed", str(ds), "--bf16", "--save-steps", "6")
    straight = identical(first, 12)
    assert first[0]["warmup"] == 4 and first[0]["total"] == 12, first[0]  # the JSON's config, filled by the Trainer
    assert first[0]["schedule"] == {"total_steps": 12, "warmup_steps": 4}, first[0]  # and report() says so
    assert first[0]["engine_bf16"] and first[0]["weight_dtype"] == "torch.bfloat16", first[0]
    checkpoint = tmp_path / "run" / "checkpoint-6"
    assert (checkpoint / "global_step6").is_dir() and (checkpoint / "replica1" / "global_step6").is_dir()
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(checkpoint, resumed_dir / "checkpoint-6")
    resumed = torchrun("hf_trainer.py", resumed_dir, "--deepspeed", str(ds), "--bf16", "--save-steps", "6", "--resume")
    assert identical(resumed, 12) == straight


# --------------------------------------------------------------------------
# Lightning
# --------------------------------------------------------------------------


AB_EVERY_6 = ("--hook", "ab", "--save-every", "6")


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    """Every Lightning run of this module, in one launch: AB saving every 6 steps, a second run in the same folder
    on other data (Lightning saves its checkpoints as -v1, and its per-rank state goes to a run folder of its own),
    the resume from the first run's .ckpt, QSR in bf16 keeping one checkpoint, and a NaN.  The refusals (which
    change the first run's files) launch again in their test."""
    root = tmp_path_factory.mktemp("lightning")
    ab = AB_EVERY_6
    runs = torchrun_runs("lightning_run.py", {
        "ab": (root / "ab", *ab),
        "other": (root / "ab", *ab, "--data-offset", "100", "--report", str(root / "other-report")),
        "resumed": (root / "resumed", *ab, "--resume", str(root / "ab" / "ckpt" / "epoch=0-step=6.ckpt")),
        # save_top_k=1: one .ckpt kept, and one per-rank checkpoint; the rule's warm-up from the lr scheduler
        "qsr": (root / "qsr", "--hook", "qsr", "--accum", "2", "--bf16", "--save-every", "2", "--save-top-k", "1"),
        "nan": (root / "nan", "--hook", "qsr", "--nan-at", "4")})
    return root, runs


@pytest.mark.xdist_group("lightning")
def test_lightning_resumes_bit_exact(lightning_runs):
    root, runs = lightning_runs
    straight = identical(runs["ab"], 12)
    assert runs["ab"][0]["warmup"] == 3  # AB's own phase warm-up, as configured (QSR's rule warm-up is filled below)
    assert identical(runs["other"], 12) != straight
    assert (root / "ab" / "ckpt" / "epoch=0-step=6-v1.ckpt").is_file()
    assert identical(runs["resumed"], 12) == straight  # bit-exact from Lightning's own checkpoint (an epoch's end)


@pytest.mark.xdist_group("lightning")
def test_lightning_refuses_a_foreign_or_missing_per_rank_state(lightning_runs):
    """Two launches of their own: between them the first run's per-rank state (the folder its .ckpt names) is
    replaced, then removed."""
    root, _ = lightning_runs
    ckdir = root / "ab" / "ckpt"
    ckpt = ckdir / "epoch=0-step=6.ckpt"
    # the folder the first run's .ckpt names, holding the second run's files: refused, naming it
    import torch

    named = torch.load(ckpt, map_location="cpu", weights_only=False)["commhooks"]["dir"]
    theirs = torch.load(ckdir / "epoch=0-step=6-v1.ckpt", map_location="cpu", weights_only=False)["commhooks"]["dir"]
    assert named != theirs
    shutil.rmtree(Path(named) / "step-00000006")
    shutil.copytree(Path(theirs) / "step-00000006", Path(named) / "step-00000006")
    foreign_dir, refused_dir = root / "foreign", root / "refused"
    foreign = torchrun_runs("lightning_run.py", {"foreign": (foreign_dir, *AB_EVERY_6, "--resume", str(ckpt))})
    foreign_everywhere(foreign["foreign"], "Lightning")
    assert named in foreign["foreign"][0]["error"], foreign["foreign"][0]["error"]
    shutil.rmtree(ckdir / "commhooks")  # Lightning's file names where they were: gone
    refused = torchrun_runs("lightning_run.py", {"refused": (refused_dir, *AB_EVERY_6, "--resume", str(ckpt))})
    refused_everywhere(refused["refused"], "Lightning")
    assert named in refused["refused"][0]["error"], refused["refused"][0]["error"]  # the folder the .ckpt recorded



@pytest.mark.xdist_group("lightning")
def test_lightning_qsr_keeps_one_checkpoint_and_names_a_nan(lightning_runs):
    root, runs = lightning_runs
    identical(runs["qsr"], 12)
    assert runs["qsr"][0]["warmup"] == 4, runs["qsr"][0]
    kept = [p.name for p in (root / "qsr" / "ckpt").glob("*.ckpt")]
    assert len(kept) == 1 and kept[0].endswith("step=12.ckpt"), kept
    assert [Path(p).name for p in per_rank_steps(root / "qsr" / "ckpt")] == ["step-00000012"]
    nan_named_everywhere(runs["nan"], 4)


FRAMEWORK_BASE = {  # what an integration must import of its framework: nothing more may come with it
    "accelerate": "import accelerate",
    "transformers": "from transformers import TrainerCallback",
    "lightning": "from lightning.pytorch.callbacks import Callback",
}


def _frameworks_loaded(code: str) -> list:
    probe = (f"import sys; {code}; print(sorted(m for m in ('accelerate', 'transformers', 'lightning', "
             "'pytorch_lightning') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1].replace("'", '"'))


@pytest.mark.parametrize("framework", ["accelerate", "transformers", "lightning"])
def test_the_integrations_import_only_their_framework(framework):
    """`import commhooks` pulls in no framework; each integration loads no framework beyond what its own
    framework's base class brings (transformers' TrainerCallback imports accelerate; Lightning's Callback imports
    transformers where it is installed: theirs, not ours)."""
    if framework == "accelerate":  # once
        assert _frameworks_loaded("import commhooks") == []
    ours = _frameworks_loaded(f"import commhooks.integrations.{framework}")
    theirs = _frameworks_loaded(FRAMEWORK_BASE[framework])
    assert set(ours) <= set(theirs) and framework in theirs, (framework, ours, theirs)


def test_the_lr_warmup_is_read_off_a_scheduler_and_the_scheduler_put_back():
    """Lightning knows the scheduler, not its warm-up: it is the steps until the lr stops rising, found by stepping
    the scheduler on the side; the scheduler, the lr and the momentum (one-cycle moves it too) are as before."""
    import torch

    from commhooks.integrations._common import lr_warmup_steps

    def fresh(kind):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
        if kind == "linear-5":  # lr 0 at step 0, the peak from step 5, then cosine
            return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(s / 5, 0.5 * (1 + math.cos(s / 40))))
        if kind == "one-cycle":
            return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=40, pct_start=0.25)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)  # never rises

    import math

    for kind, expected in (("linear-5", 5), ("one-cycle", 9), ("step", None)):
        opt, sched = fresh(kind)
        before = ({k: v for k, v in opt.param_groups[0].items() if k != "params"}, sched.state_dict())
        assert lr_warmup_steps(sched, 100) == expected, kind
        after = ({k: v for k, v in opt.param_groups[0].items() if k != "params"}, sched.state_dict())
        assert after == before, (kind, before, after)


def test_refusals_name_the_setting_that_causes_them():
    """The Lightning callback on a sharded strategy names it and FSDP; the Trainer callback under deepspeed= with
    use_cpu=True (which switches DeepSpeed off in the Trainer) names use_cpu.  The frameworks' real objects; the
    Trainer's arguments only as far as the callback reads them."""
    from types import SimpleNamespace

    import torch
    from lightning.pytorch.strategies import FSDPStrategy

    from commhooks.config import ConfigError
    from commhooks.integrations.lightning import CommHookCallback as LightningHook
    from commhooks.integrations.transformers import CommHookCallback as TrainerHook

    with pytest.raises(ConfigError, match=r"strategy is FSDPStrategy.*sharded model \(FSDP.*commhooks\.fsdp"):
        LightningHook({"type": "qsr", "h_base": 2}).on_fit_start(
            SimpleNamespace(precision="32-true", strategy=FSDPStrategy()), None)
    with pytest.raises(ConfigError, match=r"deepspeed='ds.json'.*use_cpu=True.*switches DeepSpeed off"):
        TrainerHook({"type": "qsr", "h_base": 2})._begin_deepspeed(
            SimpleNamespace(deepspeed="ds.json", use_cpu=True), None, torch.nn.Linear(2, 2))


def _accelerate_fsdp(rank, world):
    """Accelerate with a model FSDP2 shards (as its FSDP plugin does): register refuses, naming why."""
    import torch
    from accelerate import Accelerator
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from commhooks.config import ConfigError
    from commhooks.integrations import accelerate as acc_hook

    accelerator = Accelerator(cpu=True)
    model = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (world,)))
    try:
        acc_hook.register(accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1), {"type": "qsr"})
    except ConfigError as exc:
        return str(exc)
    return None


def test_accelerate_refuses_its_fsdp_naming_the_route_that_works():
    from tests.dist import run_ranks

    for said in run_ranks(_accelerate_fsdp, 2, timeout=120):
        assert said is not None and "Accelerate's FSDP plugin" in said and "commhooks.fsdp.register" in said, said
