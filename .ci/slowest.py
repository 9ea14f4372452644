"""The end of `make test`: its wall time, the tests per leg and the 10 slowest, from pytest's JUnit reports.

    python .ci/slowest.py --since EPOCH_SECONDS REPORT.xml...

A test's time is its call plus its fixtures' setup and teardown (JUnit's ``time``), so a test that pays for a
module fixture shows it.  Printed last, so the next regression is seen where it happens."""

import argparse
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--since", type=float, required=True, help="the run's start (seconds since the epoch)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("reports", nargs="*", type=Path)
    args = p.parse_args()
    rows, legs = [], []
    for report in args.reports:
        if not report.exists():
            continue
        suite = ET.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        legs.append(f"{report.stem}: {counts['tests']} tests in {float(suite.get('time', 0)):.0f} s "
                    f"({counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped)")
        for case in suite.iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            rows.append((float(case.get("time", 0)), report.stem, name))
    wall = time.time() - args.since
    print(f"\n===== make test: {int(wall // 60)} min {int(wall % 60):02d} s wall =====")
    for leg in legs:
        print("  " + leg)
    print(f"the {args.top} slowest tests (seconds, setup + call + teardown):")
    for seconds, leg, name in sorted(rows, reverse=True)[: args.top]:
        print(f"  {seconds:7.1f}  {leg:<21} {name}")


if __name__ == "__main__":
    main()
