"""Counting what faults cost, from hand-written records: only faults that hit training count (not one during a
restart's start-up, not one after the last step); each failure is put on the fault that caused it; live groups
are called identical only where two or more finished, and the loss gap comes with the fault-free seed spread."""

import json

from commhooks.tools.fault_report import (ENDED, HIT, STARTING, count_faults, groups_identical, identical_cell,
                                          table)


def fault(at, kind, target, attempt, step, duration=0.0):
    return {"at_s": at, "kind": kind, "target": target, "duration_s": duration, "at_step": None,
            "attempt": attempt, "step": step, "injected_s": at}


def restart_report():
    """Restarts, 100 steps: a kill that hits at step 50; a kill while attempt 1 starts (no step yet); a link down
    that hits at step 60, then a kill at step 70 in the same attempt (the kill ends it); a link down at step 75
    noticed 20 s later; a stall once step 100 was reached."""
    faults = [fault(10.0, "kill", 1, 0, 50), fault(12.0, "kill", 0, 1, None),
              fault(20.0, "link-down", 1, 2, 60, 25.0), fault(30.0, "kill-node", 0, 2, 70),
              fault(40.0, "link-down", 0, 3, 75, 25.0), fault(70.0, "stall", 2, 4, 100, 25.0)]
    failures = [{"attempt": 0, "at_s": 10.1, "failed_ranks": [1], "step": 50},
                {"attempt": 1, "at_s": 12.05, "failed_ranks": [0], "step": None},
                {"attempt": 2, "at_s": 30.05, "failed_ranks": [0, 1], "step": 70},
                {"attempt": 3, "at_s": 60.0, "failed_ranks": [0], "step": 78}]
    restarts = [{"attempt": 1, "at_s": 11.0, "resumed_from": None}, {"attempt": 2, "at_s": 14.0, "resumed_from": 40},
                {"attempt": 3, "at_s": 32.0, "resumed_from": 60}, {"attempt": 4, "at_s": 62.0, "resumed_from": 70}]
    summary = {"steps": 100, "val_loss": 2.0, "params_sha256": "a"}
    return {"argv": [], "faulted": {"faults": faults, "failures": failures, "restarts": restarts, "wall_s": 80.0,
                                    "summary": summary},
            "reference": {"wall_s": 50.0, "summary": dict(summary)}}


def test_restarts_count_only_faults_that_hit_training_and_put_each_failure_on_its_cause():
    counted = count_faults(restart_report())
    assert [c["outcome"] for c in counted] == [HIT, STARTING, HIT, HIT, HIT, ENDED]
    # the kill at step 50 and the kill-node at step 70 ended their attempts at once; the link down before that
    # kill was overtaken (its attempt's cost is the kill's); the link down at step 75 was noticed 20 s later
    assert [c["caused_failure"] for c in counted] == [True, False, False, True, True, False]
    assert [c["detect_s"] for c in counted] == [0.1, None, None, 0.05, 20.0, None]
    # steps lost: back to the step the next attempt resumed from (attempt 1 found no checkpoint and never trained)
    assert [c["steps_lost"] for c in counted] == [10, 0, 0, 10, 8, 0]


def test_restart_table_counts_hits_apart_from_misses(tmp_path):
    for seed in (0, 1):
        (tmp_path / f"seed{seed}").mkdir()
        (tmp_path / f"seed{seed}" / "faults.json").write_text(json.dumps(restart_report()))
    out = table([str(tmp_path / f"seed{s}" / "faults.json") for s in (0, 1)])
    # run | injected | hit training | hit a start-up | after the last step | failures | restarts | steps redone
    assert "| seed0 | 6 | 4 | 1 | 1 | 4 | 4 | 28 |" in out, out
    assert "| kill | 4 | 2 | 2 | 0 | 2 | 0.10 / 0.10 (0.10-0.10) | 10.0 / 10.0 (10.0-10.0) |" in out, out
    assert "| stall | 2 | 0 | 0 | 2 | 0 | - | - |" in out, out
    assert "| **all** | 12 | 8 | 2 | 2 | 6 |" in out, out


def test_groups_are_called_identical_only_where_two_finished():
    a, b = {"params_sha256": "a"}, {"params_sha256": "b"}
    assert groups_identical([a]) is None and groups_identical([]) is None
    assert groups_identical([a, dict(a)]) is True and groups_identical([a, b]) is False
    assert identical_cell([a]) == "n/a (1 group finished)"
    assert identical_cell([a, dict(a)]) == "yes (2 finished)" and identical_cell([a, b]) == "NO (2 finished)"


def live_report(tmp_path, groups, loss, ref_loss):
    """Live groups, 100 steps: group 1 killed at step 30 (it had committed steps), restarted, killed again 0.5 s
    later while starting (its log has no commit), restarted; then group 0 killed at step 60 while group 1 was still
    joining: no group alive, the job began again at 0 (the next step read is 20)."""
    logs = tmp_path / "faulted"
    logs.mkdir(parents=True)
    committed = "[INFO] [torchft::manager] - [Replica group1] should_commit completed should_commit=true\n"
    (logs / "group0.start0.log").write_text(committed.replace("group1", "group0"))
    (logs / "group1.start0.log").write_text(committed)
    (logs / "group1.start1.log").write_text("[INFO] [torchft::manager] - [Replica group1] Start quorum\n")
    (logs / "group1.start2.log").write_text("[INFO] [torchft::manager] - [Replica group1] Start quorum\n")
    faults = [fault(3.0, "kill", 1, 0, 30), fault(5.5, "kill", 1, 1, 33), fault(8.0, "kill", 0, 2, 60),
              fault(20.0, "kill", 1, 3, 20), fault(40.0, "kill", 0, 4, 100)]
    failures = [{"group": 1, "at_s": 3.05, "step": 30}, {"group": 1, "at_s": 5.55, "step": 33},
                {"group": 0, "at_s": 8.05, "step": 60}]
    restarts = [{"group": 1, "at_s": 5.0, "log": "group1.start1.log"},
                {"group": 1, "at_s": 7.5, "log": "group1.start2.log"}]
    record = {"faults": faults, "failures": failures, "restarts": restarts, "wall_s": 45.0, "summary": {},
              "groups": [{"params_sha256": "a", "val_loss": loss}] * groups}
    report = {"argv": ["faults", "--", "--steps", "100"], "faulted": record,
              "reference": {"wall_s": 30.0, "groups": [{"params_sha256": "r", "val_loss": ref_loss}] * 2}}
    (tmp_path / "faults.json").write_text(json.dumps(report))
    return report, logs


def test_live_faults_that_hit_a_starting_group_or_the_end_do_not_count(tmp_path):
    report, logs = live_report(tmp_path, 1, 2.0, 2.0)
    counted = count_faults(report, logs)
    # the fourth kill hit group 1's third start, which never committed; the last came at step 100
    assert [c["outcome"] for c in counted] == [HIT, STARTING, HIT, STARTING, ENDED]
    assert [c["steps_lost"] for c in counted] == [0, 0, 60, 0, 0]  # only the kill that left no group alive
    assert [c["detect_s"] for c in counted] == [0.05, None, 0.05, None, None]


def test_live_table_puts_the_fault_free_seed_spread_beside_the_gap(tmp_path):
    paths = []
    for seed, (groups, loss, ref) in enumerate([(2, 2.04, 2.0), (1, 2.2, 2.2)]):
        live_report(tmp_path / f"seed{seed}", groups, loss, ref)
        paths.append(str(tmp_path / f"seed{seed}" / "faults.json"))
    out = table(paths)
    assert "| +2.0 % | yes (2 finished) |" in out and "| +0.0 % | n/a (1 group finished) |" in out, out
    assert "| **mean** | 5 | 2 | 2 | 1 |" in out and "+1.0 % |  |" in out, out
    # the fault-free losses 2.0 and 2.2: std 0.1414, 6.7 % of their mean 2.1
    assert "Fault-free final val_loss over the 2 seeds: 2.0000-2.2000 (std 0.1414, 6.7 % of their mean)" in out, out


def test_live_groups_of_two_ranks_read_every_rank_log_and_time_the_heal(tmp_path):
    """2 groups x 2 ranks (``--group-ranks 2``): torchft's lines are in rank 0's log only.  Group 1 killed at step
    30, restarted at 5.0 s (wall clock 1000.0): first quorum 7.5 s later, first commit 9.25 s later; then killed
    again while starting (no commit in either rank's log)."""
    logs = tmp_path / "faulted"
    logs.mkdir()

    def line(t, text):  # torchft's UTC timestamp: 1970-01-01T00:16:40 is 1000 s
        return f"1970-01-01T00:{int(t) // 60:02d}:{t % 60:06.3f} [INFO] [torchft::manager] - [Replica group1] {text}\n"

    commit = "should_commit completed should_commit=true"
    (logs / "group1.rank0.start0.log").write_text(line(990.0, commit))
    (logs / "group1.rank1.start0.log").write_text("")
    (logs / "group1.rank0.start1.log").write_text(line(1007.5, "got lighthouse quorum LighthouseQuorumResponse")
                                                  + line(1009.25, commit) + line(1010.0, commit))
    (logs / "group1.rank1.start1.log").write_text("")
    (logs / "group1.rank0.start2.log").write_text(line(1015.0, "Start quorum for group_rank 0"))
    (logs / "group1.rank1.start2.log").write_text("")
    faults = [fault(3.0, "kill", 1, 0, 30), fault(14.0, "kill", 1, 1, 80)]
    failures = [{"group": 1, "at_s": 3.1, "step": 30}, {"group": 1, "at_s": 14.1, "step": 80}]
    restarts = [{"group": 1, "at_s": 5.0, "at_unix": 1000.0, "log": f"group1.rank0.start{n}.log",
                 "logs": [f"group1.rank{r}.start{n}.log" for r in (0, 1)]} for n in (1, 2)]
    restarts[1].update(at_s=16.1, at_unix=1011.1)
    record = {"faults": faults, "failures": failures, "restarts": restarts, "wall_s": 45.0, "summary": {},
              "groups": [{"params_sha256": "a", "val_loss": 2.0}] * 2}
    report = {"argv": ["faults", "--", "--steps", "100"], "faulted": record}
    counted = count_faults(report, logs)
    assert [c["outcome"] for c in counted] == [HIT, HIT]  # the second start committed before its kill
    assert [(c["quorum_s"], c["heal_s"]) for c in counted] == [(7.5, 9.25), (None, None)]  # killed 2nd: never back
    (tmp_path / "faults.json").write_text(json.dumps(report))
    assert "| 9.25 / 9.25 (9.25-9.25) |" in table([str(tmp_path / "faults.json")])


def test_a_restart_that_found_no_live_group_began_the_job_again(tmp_path):
    """Group 0 killed at step 100 (10 s), restarted at 12 s; group 1 killed at 14 s before group 0 was back (the
    step read is still group 0's 100); group 0's first quorum (15 s) has only itself at torchft step 0: the job
    began again, and the kill at 14 s lost its 100 steps.  Group 1's restart (16 s) heals from it at step 3."""
    logs = tmp_path / "faulted"
    logs.mkdir()

    def quorum(t, *steps):
        members = ", ".join(f'QuorumMember {{ replica_id: "group{g}:x", step: {s}, world_size: 2 }}'
                            for g, s in enumerate(steps))
        return (f"1970-01-01T00:{int(t) // 60:02d}:{t % 60:06.3f} [INFO] [torchft::manager] - got lighthouse quorum "
                f"LighthouseQuorumResponse {{ quorum: Some(Quorum {{ quorum_id: 9, participants: [{members}], "
                f"created: Some(Timestamp {{ seconds: 1, nanos: 2 }}) }}) }}\n")

    commit = "1970-01-01T00:{}:{} [INFO] [torchft::manager] - should_commit completed should_commit=true\n"
    for g in (0, 1):
        (logs / f"group{g}.rank0.start0.log").write_text(quorum(1001.0, 0, 0) + commit.format("16", "42.000"))
        (logs / f"group{g}.rank1.start0.log").write_text("")
    (logs / "group0.rank0.start1.log").write_text(quorum(1015.0, 0) + commit.format("16", "56.000"))
    (logs / "group1.rank0.start2.log").write_text(quorum(1018.0, 3, 0) + commit.format("16", "59.500"))
    for name in ("group0.rank1.start1.log", "group1.rank1.start2.log"):
        (logs / name).write_text("")
    faults = [fault(10.0, "kill", 0, 0, 100), fault(14.0, "kill", 1, 0, 100)]
    failures = [{"group": 0, "at_s": 10.1, "step": 100}, {"group": 1, "at_s": 14.1, "step": 100}]
    restarts = [{"group": g, "at_s": t, "at_unix": 1000.0 + t, "log": f"group{g}.rank0.start{n}.log",
                 "logs": [f"group{g}.rank{r}.start{n}.log" for r in (0, 1)]}
                for g, t, n in ((0, 12.0, 1), (1, 16.0, 2))]
    record = {"faults": faults, "failures": failures, "restarts": restarts, "wall_s": 45.0, "summary": {},
              "groups": [{"params_sha256": "a", "val_loss": 2.0}] * 2}
    counted = count_faults({"argv": ["faults", "--", "--steps", "800"], "faulted": record}, logs)
    assert [c["steps_lost"] for c in counted] == [0, 100], counted
    # group 0's restart began the job again (no heal to time); group 1's healed: 2 s to its quorum, 3.5 s to commit
    assert [c["began_again"] for c in counted] == [True, False], counted
    assert [(c["quorum_s"], c["heal_s"]) for c in counted] == [(None, None), (2.0, 3.5)], counted
