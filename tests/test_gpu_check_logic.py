"""The GPU check's own logic, on the CPU, so it cannot rot between the sessions that have a GPU.

* `.ci/gpu-check.sh` in CPU mode (COMMHOOKS_GPU_CHECK_ON_CPU=1: gloo for NCCL, small sizes) runs every file of
  tests/gpu and writes its summary.  It proves nothing about GPUs; the script run on a GPU host does.
* Without CUDA (and without CPU mode) it says so and exits 0.
* A python that lacks what tests/gpu needs (the borrowed host's case: no pydantic, DeepSpeed, ...) is told
  which packages are missing when the bundle is absent, and is served from the bundle when it is there,
  installed without an index.
* The bundle `make gpu-bundle` writes holds every package tests/gpu imports that the host lacks."""

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / ".cache" / "gpu-bundle"
GPUS_PAGE = REPO / "docs" / "pages" / "operations" / "gpus.md"
# what the bundle serves: import name -> distribution (a python lacking them is the borrowed host's case)
BUNDLED = {"pydantic": "pydantic", "pydantic_core": "pydantic-core", "annotated_types": "annotated-types",
           "typing_inspection": "typing-inspection", "hostlist": "python-hostlist", "hjson": "hjson",
           "deepspeed": "deepspeed", "msgpack": "msgpack", "einops": "einops", "cpuinfo": "py-cpuinfo",
           "pynvml": "nvidia-ml-py"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _check(env, *args, timeout=900):
    return subprocess.run(["bash", str(REPO / ".ci" / "gpu-check.sh"), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **env})


# the files of tests/gpu in three runs of the script (each under a minute here, on the suite's two workers), with
# the checks each run's files record; together every file and every check the whole run had
GPU_FILE_RUNS = {
    "ranks": (["test_gpu_ranks.py"],
              {"two ranks on one device (gloo) vs CPU", "three ranks, int2 two-step exchange (gloo) vs CPU",
               "four ranks, replica groups, hierarchical (gloo) vs CPU",
               "GradScaler (torch.bfloat16) with an Inf on rank 1 (gloo)"}),
    "nccl-checkpoint-syncs": (["test_gpu_nccl.py", "test_gpu_checkpoint.py", "test_gpu_syncs.py"],
                              {"three ranks, every collective (gloo)", "host syncs per step (commhooks code)",
                               "checkpoint round trip ab-mid-phase", "checkpoint round trip qsr-mid-overlap"}),
    "memory-deepspeed": (["test_gpu_memory.py", "test_gpu_deepspeed.py"],
                         {"memory per feature (x bf16 weight bytes)", "DeepSpeed bf16-zero2"}),
}


def test_the_file_runs_cover_every_gpu_file_and_the_script_runs_them_all_by_default():
    """The parametrised runs below take every file of tests/gpu once; the script itself, given no GPU_CHECK_FILES,
    runs every file it has a time limit for, and it has one for each file of tests/gpu."""
    on_disk = {p.name for p in (REPO / "tests" / "gpu").glob("test_*.py")}
    chosen = [f for files, _ in GPU_FILE_RUNS.values() for f in files]
    assert sorted(chosen) == sorted(on_disk), (chosen, on_disk)
    limits = re.search(r'^LIMITS="([^"]*)"', (REPO / ".ci" / "gpu-check.sh").read_text(), re.M).group(1)
    assert {e.split(":")[0] for e in limits.split()} == on_disk, limits


@pytest.mark.parametrize("run", list(GPU_FILE_RUNS))
def test_gpu_check_runs_its_logic_on_the_cpu(run, tmp_path):
    files, expected_checks = GPU_FILE_RUNS[run]
    proc = _check({"COMMHOOKS_GPU_CHECK_ON_CPU": "1", "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions"),
                   "GPU_CHECK_FILES": " ".join(files)}, str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.stdout.startswith("gpu-check: python"), proc.stdout[:300]  # the versions come first
    summary = json.loads((tmp_path / "summary.json").read_text())
    ran = summary["files"]
    assert set(ran) == set(files), ran
    for name, row in ran.items():
        assert row["failed"] == 0 and not row["timed_out"] and row["passed"] >= 1, (name, row)
    if "test_gpu_deepspeed.py" in ran:  # fp16 with FusedAdam cannot run on the CPU: a skip with its reason, never silent
        assert ran["test_gpu_deepspeed.py"]["skipped"] == 2, ran["test_gpu_deepspeed.py"]
        assert all("needs CUDA" in r for r in ran["test_gpu_deepspeed.py"]["skip_reasons"])
    rows = summary["figures"]
    assert rows and all(r["target"].startswith("CPU MODE") for r in rows), rows
    checks = {r["check"] for r in rows}
    assert expected_checks <= checks, checks


def test_without_cuda_it_says_so_and_exits_0(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "COMMHOOKS_GPU_CHECK_ON_CPU"}
    proc = subprocess.run(["bash", str(REPO / ".ci" / "gpu-check.sh"), str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CUDA is not available" in proc.stdout and "nothing to check" in proc.stdout, proc.stdout
    assert json.loads((tmp_path / "summary.json").read_text()) == {"skipped": "CUDA is not available"}


def _python_without_the_bundle(where: Path) -> Path:
    """A python with torch and pytest but none of what the bundle serves, as on the borrowed host: a venv whose
    only packages are links to this one's, less the bundled ones."""
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(where / "venv")], check=True, timeout=120)
    farm = where / "farm"
    farm.mkdir()
    ours = Path(sysconfig.get_paths()["purelib"])
    hidden = {_norm(m) for m in BUNDLED} | {_norm(d) for d in BUNDLED.values()}
    for entry in ours.iterdir():
        stem = _norm(re.split(r"-\d", entry.name)[0].removesuffix(".py").removesuffix(".pth"))
        if stem in hidden or entry.suffix == ".pth" or entry.name.startswith("__editable__"):
            continue
        (farm / entry.name).symlink_to(entry)
    site = next((where / "venv" / "lib").glob("python*/site-packages"))
    (site / "farm.pth").write_text(str(farm) + "\n")
    return where / "venv" / "bin" / "python"


def test_a_python_lacking_packages_is_told_which_then_served_from_the_bundle(tmp_path):
    py = _python_without_the_bundle(tmp_path)
    probe = subprocess.run([str(py), "-c", "import torch, pytest, pip; import pydantic"], capture_output=True, text=True)
    assert "No module named 'pydantic'" in probe.stderr, probe.stderr  # the host's case, and torch is there
    env = {"GPU_PY": str(py), "COMMHOOKS_GPU_CHECK_ON_CPU": "1", "GPU_SITE": str(tmp_path / "site"),
           "GPU_CHECK_FILES": "test_gpu_nccl.py"}
    # no bundle: every missing package named, nothing run
    proc = _check({**env, "GPU_BUNDLE": str(tmp_path / "no-bundle")}, str(tmp_path / "out1"), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    for package in ("pydantic", "python-hostlist", "hjson", "deepspeed"):
        assert package in proc.stderr, (package, proc.stderr)
    assert "make gpu-bundle" in proc.stderr and not (tmp_path / "out1" / "summary.json").exists()
    # a bundle for this python (the real one is for the host's 3.12), made by the same script, then the check
    made = subprocess.run(["bash", str(REPO / ".ci" / "gpu-bundle.sh"), str(tmp_path / "bundle")], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "GPU_BUNDLE_PYTHON": f"{sys.version_info[0]}.{sys.version_info[1]}"})
    assert made.returncode == 0, made.stdout + made.stderr
    proc = _check({**env, "GPU_BUNDLE": str(tmp_path / "bundle")}, str(tmp_path / "out2"), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "installing the bundle" in proc.stdout, proc.stdout
    files = json.loads((tmp_path / "out2" / "summary.json").read_text())["files"]
    assert list(files) == ["test_gpu_nccl.py"] and files["test_gpu_nccl.py"]["passed"] == 1, files


def _host_packages() -> set:
    """The host's list (docs/pages/operations/gpus.md, between its markers), with the dependencies each of them
    declares, as this machine's installed metadata tells (the host installed them with theirs), less what the page
    says the host was seen to lack (this machine's versions may depend on more than the host's)."""
    from importlib import metadata

    text = GPUS_PAGE.read_text()

    def block(name):
        inside = text.split(f"<!-- {name} -->")[1].split(f"<!-- /{name} -->")[0]
        return {_norm(m.group(1)) for m in re.finditer(r"`([A-Za-z0-9_.-]+)", inside)}

    named, lacks = block("host-packages"), block("host-lacks")
    assert {"pydantic", "deepspeed"} <= lacks, lacks
    assert {"torch", "pytest", "pytest-timeout"} <= named, named
    closure, todo = set(), list(named)
    while todo:
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for req in requires:
            if "extra ==" in req:
                continue
            todo.append(_norm(re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0]))
    return closure - lacks


IMPORTS = r"""
import importlib, json, os, sys
from pathlib import Path
os.environ["COMMHOOKS_GPU_CHECK_ON_CPU"] = "1"
for f in sorted(Path("tests/gpu").glob("*.py")):
    importlib.import_module(f"tests.gpu.{f.stem}")
import deepspeed, commhooks.deepspeed, commhooks.launch, hostlist  # a test imports DeepSpeed when it runs; the library hostlist
import importlib.metadata as md
dists = md.packages_distributions()
tops = {m.split(".")[0] for m in list(sys.modules)}
print(json.dumps(sorted({d for t in tops if t.lstrip("_") not in sys.stdlib_module_names for d in dists.get(t, [])})))
"""


def test_the_bundle_holds_every_package_tests_gpu_imports_that_the_host_lacks():
    wheels = sorted(BUNDLE.glob("*.whl"))
    assert wheels, f"{BUNDLE} holds no wheel: `make gpu-bundle` writes it (make test does first)"
    size = sum(w.stat().st_size for w in wheels)
    assert size < 30 * 2 ** 20, f"the bundle is {size / 2 ** 20:.1f} MiB, over 30"
    held = {_norm(w.name.split("-")[0]) for w in wheels}
    assert len(held) == len(wheels), [w.name for w in wheels]  # one version of each package
    assert all(("cp312" in w.name or "none-any" in w.name) for w in wheels), [w.name for w in wheels]
    proc = subprocess.run([sys.executable, "-c", IMPORTS], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{REPO / 'hooks'}:{REPO}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = {_norm(d) for d in json.loads(proc.stdout.strip().splitlines()[-1])} - {"commhooks"}
    host = _host_packages()
    needed = imported - host
    assert {"pydantic", "deepspeed", "hjson", "python-hostlist"} <= needed, (needed, host)
    assert needed <= held, f"tests/gpu imports {sorted(needed - held)}, which neither the host nor the bundle has"
