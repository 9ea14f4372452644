# Sourced by .ci/test.sh and .ci/oldest-torch.sh: one leg of the suite in its two phases.
#
#   pytest_phases PYTHON NAME PYTEST-ARGS...
#
# First the tests not marked `serial`, on TEST_WORKERS pytest-xdist workers (default 2, the cores here; tests that
# share a module fixture carry an xdist_group and stay on one worker), then the `serial` ones alone, on a quiet
# machine (see pyproject.toml).  JUnit reports go to .cache/test-reports/NAME-parallel.xml and NAME-serial.xml,
# which .ci/slowest.py reads.  A failing phase sets `status`; exit 5 (nothing selected) is no failure.
pytest_phases() {
    local python=$1 name=$2 phase rc
    shift 2
    mkdir -p .cache/test-reports
    for phase in parallel serial; do
        local select=(-m serial)
        if [ "$phase" = parallel ]; then select=(-n "${TEST_WORKERS:-2}" --dist loadgroup -m "not serial"); fi
        echo "test: $name, $phase"
        "$python" -m pytest -q --junitxml=".cache/test-reports/$name-$phase.xml" "${select[@]}" "$@"
        rc=$?
        if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=$rc; fi
    done
}
