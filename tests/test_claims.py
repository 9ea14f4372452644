"""Claims as code (issue 50): every figure of the measured sections is computed from its results file."""

import importlib.util
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("claims", REPO / "docs" / "claims.py")
claims = importlib.util.module_from_spec(spec)
spec.loader.exec_module(claims)


def test_every_figure_of_the_measured_sections_comes_from_its_results_file():
    problems = claims.check()
    assert not problems, "\n".join(problems)
    assert "README.md" in claims.sectioned() and len(claims.load()) >= 20


def _copy_prose(tmp_path):
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    shutil.copytree(REPO / "docs" / "pages", tmp_path / "docs" / "pages")
    return tmp_path / "README.md"


def test_a_changed_figure_fails_naming_the_line_and_the_source(tmp_path):
    """A results-page line mutated as a rerun would leave it: the old figure where the data now give another."""
    _copy_prose(tmp_path)
    readme = tmp_path / "docs" / "pages" / "tools" / "results.md"
    text = readme.read_text()
    line = next(x for x in text.splitlines() if x.startswith("| int2, longer QSR periods (`qsr_diloco_int2_a0125`) |"))
    readme.write_text(text.replace(line, line.replace("15.55x", "15.65x")))
    problems = claims.check(tmp_path)
    assert any("'15.55x" in p and "does not say" in p for p in problems), problems
    assert any("'15.65x' has no claim" in p for p in problems), problems


def test_a_figure_without_a_source_fails_and_setup_is_not_a_figure(tmp_path):
    readme = _copy_prose(tmp_path)
    text = readme.read_text()
    readme.write_text(text.replace("<!-- /claims -->", "QSR was 1.7x faster on 4 ranks over 1000 steps (2026-12-06).\n"
                                   "<!-- /claims -->", 1))
    problems = claims.check(tmp_path)
    assert len(problems) == 1 and "'1.7x' has no claim" in problems[0], problems
    assert claims.figures("4 ranks on 2 nodes, 100 Mbit/s, seeds 3-5, `int2_h4.json`, 2026-12-06, int2") == []
    assert claims.figures("0.9312 at 1.05x [1.02-1.08], +1.0 % and 0.055 %") == [
        "0.9312", "1.05x", "1.02", "1.08", "+1.0 %", "0.055 %"]
    # a figure ends a sentence, or sits after a slash; a decimal "count" is a measurement, not set-up
    assert claims.figures("it gave 1.045x. Then 1.3760.") == ["1.045x", "1.3760"]
    assert claims.figures("seeds gave 1.02/1.08") == ["1.02", "1.08"]
    assert claims.figures("a period of 12.5 steps on 4 ranks") == ["12.5"]


def test_a_figure_that_is_part_of_a_claimed_one_is_not_sourced_by_it(tmp_path):
    """"2 %" beside a claimed "0.227 %", or "4" beside "1.4149", is a figure of its own."""
    _copy_prose(tmp_path)
    readme = tmp_path / "docs" / "pages" / "tools" / "results.md"
    text = readme.read_text()
    line = next(x for x in text.splitlines() if x.startswith("| int2, longer QSR periods (`qsr_diloco_int2_a0125`) |"))
    readme.write_text(text.replace(line, line + " 2 % |"))
    problems = claims.check(tmp_path)
    assert len(problems) == 1 and "'2 %' has no claim" in problems[0], problems


def test_a_ratio_across_two_runs_must_say_so(tmp_path):
    """A claim reading two results files (``source2``) stands only in a section that says so (``crosses``)."""
    _copy_prose(tmp_path)
    readme = tmp_path / "docs" / "pages" / "tools" / "results.md"
    cross = {"file": "docs/pages/tools/results.md", "line": "| DDP |", "figure": "0.919",
             "source": "results/bench-protocol-mnist1d-2026-12-06/results.json",
             "source2": "results/bench-gpt-1000steps-int2-2026-12-05/results.json", "crosses": "divide two runs",
             "value": "m['ddp']['quality_heldout_mean']", "format": "{:.3f}"}
    problems = claims.check(tmp_path, claims=claims.load() + [cross])
    assert problems and all("divides figures of two runs" in p for p in problems), problems
    text = readme.read_text()
    readme.write_text(text.replace("| method | test accuracy", "Its DDP row's figures divide two runs.\n\n"
                                   "| method | test accuracy", 1))
    assert claims.check(tmp_path, claims=claims.load() + [cross]) == []


def test_a_generated_table_is_sourced_row_by_row_and_a_changed_cell_fails(tmp_path):
    """A ``[[table]]`` entry: the rows a function writes from the results file must stand in the claims section
    exactly; their figures need no claim each, and a cell edited by hand (or left behind by a rerun) fails."""
    _copy_prose(tmp_path)
    entry = {"file": "docs/pages/extra.md", "source": "results/curves-mnist1d-2026-12-07/curves.json",
             "rows": "commhooks.tools.curves:verdict_rows", "args": {"variant": "fp32"}}
    rows = claims.table_rows(entry)
    page = tmp_path / "docs" / "pages" / "extra.md"
    page.write_text("\n".join(["<!-- claims -->", "| rule point | syncs | rule | there | difference | verdict |",
                               "|---|---|---|---|---|---|", *rows, "<!-- /claims -->", ""]))
    assert len(rows) == 6 and claims.check(tmp_path, tables=claims.load_tables() + [entry]) == []
    edited = rows[0].rsplit("|", 2)[0] + "| above |"  # the verdict cell, and a figure, edited by hand
    page.write_text(page.read_text().replace(rows[0], edited.replace("+0.15", "+0.25")))
    problems = claims.check(tmp_path, tables=claims.load_tables() + [entry])
    assert any("is on 0 lines" in p and rows[0][:40] in p for p in problems), problems
    assert any("'+0.25' has no claim" in p for p in problems), problems


def test_headline_rows_of_a_protocol_run_hold_its_held_out_quality_paired_difference_and_intervals():
    """``tables.headline_rows`` on the recorded MNIST-1D protocol run: quality on the held-out seeds 3-5, the
    search seeds' in brackets, the mean seed-by-seed difference from DDP with its range (accuracy: points), the
    bytes and their share of DDP's, and both paired time ratios with their intervals; DDP and compute-only
    leave their own cells empty."""
    import json

    from commhooks.tools.tables import headline_rows

    results = json.loads((REPO / "results/bench-protocol-mnist1d-2026-12-06/results.json").read_text())
    ddp, floor, int2 = headline_rows(results, ["ddp", "compute-only", "qsr-diloco-int2-a0125"],
                                     labels={"qsr-diloco-int2-a0125": "int2"})
    assert ddp == "| ddp | 0.919 | (0.919) | - | 1200 | 892.8 | - | 18.78x [18.00-20.44] resolved | - |", ddp
    assert floor.startswith("| compute-only | 0.917 | (0.912) | -0.2 points (-1.2 to +0.8) | - | 0.0 | 0.00 % | - | 18.78x [18.00-20.44] resolved |"), floor
    assert int2 == ("| int2 | 0.932 | (0.939) | +1.4 points (+1.3 to +1.4) | 41 | 2.1 | 0.23 % | "
                    "1.21x [1.13-1.30] resolved | 15.55x [13.42-17.81] resolved |"), int2


def test_fewer_than_nine_repeats_print_a_range_and_never_resolved(tmp_path):
    """An interval from 3 repeats is their range, which covers the median far less often than 95 %: the cell says
    the range and the count, the ratio is not resolved, and a table row edited to say "resolved" fails."""
    import sys

    sys.path.insert(0, str(REPO / "hooks"))
    from commhooks.tools import timing

    few = timing.paired_ratio([2.0, 2.2, 2.1], [1.0, 1.0, 1.0])
    assert few["resolved"] is False and few["interval"] == "range" and (few["lo"], few["hi"]) == (2.0, 2.2)
    assert timing.describe(few) == "2.10x (range 2.00-2.20 of 3 repeats)"
    nine = timing.paired_ratio([2.0 + 0.01 * k for k in range(9)], [1.0] * 9)
    assert nine["resolved"] is True and timing.describe(nine).endswith(" resolved")
    readme = _copy_prose(tmp_path)
    text = readme.read_text()
    line = next(x for x in text.splitlines() if x.startswith("| DDP (every step) |"))
    assert "of 3 repeats)" in line, line
    edited = line.replace("7.68x (range 7.40-8.26 of 3 repeats)", "7.68x [7.40-8.26] resolved")
    readme.write_text(text.replace(line, edited))
    problems = claims.check(tmp_path)
    assert any("is on 0 lines" in p and "DDP (every step)" in p for p in problems), problems


def test_a_comparison_in_prose_without_a_claim_fails(tmp_path):
    """"on every seed", "within about", "faster than" in a claims section must be a claim's computed figure."""
    readme = _copy_prose(tmp_path)
    text = readme.read_text()
    readme.write_text(text.replace("<!-- /claims -->", "A sync every 2 steps comes nearer DDP's loss on every seed.\n"
                                   "<!-- /claims -->", 1))
    problems = claims.check(tmp_path)
    assert any("the comparison 'on every seed' is prose, not a claim" in p for p in problems), problems
    assert any("the comparison 'nearer' is prose, not a claim" in p for p in problems), problems
