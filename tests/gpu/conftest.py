"""``make gpu-check``: the checks only a CUDA GPU can run (tests/gpu/README.md says what each shows).

Where CUDA is absent every test here is skipped, and the reason is printed.  ``COMMHOOKS_GPU_CHECK_ON_CPU=1``
runs the same checks on the CPU (gloo instead of NCCL, small sizes): that is how the check
itself is developed and kept working on machines without a GPU; it proves nothing about GPUs.
"""

import pytest

from tests.gpu.common import TARGET, WHY_SKIPPED


def pytest_report_header(config):
    if TARGET is None:
        return f"gpu-check: SKIPPED, {WHY_SKIPPED}"
    return f"gpu-check: on {TARGET.device} ({TARGET.describe})"


def pytest_collection_modifyitems(config, items):
    if TARGET is None:
        skip = pytest.mark.skip(reason=WHY_SKIPPED)
        for item in items:
            if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
                item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    if TARGET is None:
        terminalreporter.write_line(f"gpu-check: nothing ran on a GPU ({WHY_SKIPPED})", yellow=True)
