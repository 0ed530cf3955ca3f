"""(a) The compiled-kernel tests: `pytest -m accelerator` over tests/, summarised as JSON.

    python -m benchmarks.device.kernels --out kernels.json [--smoke] [--quick] [--budget S]

Only the test files that mark accelerator tests (`mark.accelerator` in their text) are
collected: the others cannot hold one, and some import packages the device image lacks (the
HTTP server's), which would fail their collection. tests/conftest.py skips accelerator tests
where jax sees no GPU or TPU, so on CPU (the smoke) every one is reported skipped. Plain pytest
runs them, with hypothesis's plugin and no other installed plugin (loading them all costs
seconds; the tests use none). The JSON is
rewritten after every test (a part stopped by its timeout keeps the outcomes so far), and a
test not started by 85% of the budget is skipped as out of time (status "partial"). Status
"ok": no test failed or errored, collection included. --quick runs the same tests (run.sh runs
this part last, so it gets what the parts before it left of their budgets).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

from benchmarks.device.report import Part, parser

TESTS = pathlib.Path(__file__).resolve().parents[2] / "tests"


OUTCOMES = ("passed", "failed", "skipped", "error")


class Collector:
    """A pytest plugin keeping each test's outcome (and each failed collection) in `part`'s JSON
    as it goes, and skipping the tests that start past 85% of the part's budget."""

    def __init__(self, part: Part):
        self.part = part
        self.tests: list[dict] = []
        self.collect_errors: list[dict] = []

    def counts(self) -> dict:
        outcomes = [t["outcome"] for t in self.tests]
        return {k: outcomes.count(k) for k in OUTCOMES}

    def save(self) -> None:
        self.part.set(
            counts=self.counts(),
            collect_errors=self.collect_errors,
            failures=[t for t in self.tests if t["outcome"] in ("failed", "error")],
            rows=[{k: t[k] for k in ("test", "outcome", "duration_s")} for t in self.tests],
        )

    def pytest_runtest_setup(self, item):
        import pytest

        if self.part.out_of_time(0.85):
            self.part.skip(f"{item.nodeid}: out of time")
            pytest.skip("the device suite's kernels part is out of time")

    def pytest_runtest_logreport(self, report):
        failed_setup = report.when in ("setup", "teardown") and report.failed
        if report.when == "call" or failed_setup or (report.when == "setup" and report.skipped):
            outcome = "error" if failed_setup else report.outcome
            detail = str(report.longrepr)[-2000:] if report.longrepr else None
            test = dict(test=report.nodeid, outcome=outcome, duration_s=report.duration)
            self.tests.append(test | dict(detail=detail))
            self.save()

    def pytest_collectreport(self, report):
        if report.failed:
            detail = str(report.longrepr)[-2000:]
            self.collect_errors.append(dict(module=report.nodeid, detail=detail))
            self.save()


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    with Part("kernels", args) as part:
        import pytest

        from benchmarks.device.measure import device_info

        part.set(device=device_info())  # what the tests' jax sees: on CPU, everything skips
        files = sorted(p for p in TESTS.glob("test_*.py") if "mark.accelerator" in p.read_text())
        part.set(files=[p.name for p in files])
        collector = Collector(part)
        collector.save()
        args = [*map(str, files), "-m", "accelerator", "-q", "-p", "no:cacheprovider"]
        # plain pytest and hypothesis's plugin: the tests use no other plugin, and loading every
        # installed one (the test stack's clients, schema fuzzers) costs seconds
        os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        if importlib.util.find_spec("_hypothesis_pytestplugin"):
            args += ["-p", "_hypothesis_pytestplugin"]
        code = int(pytest.main(args, plugins=[collector])) if files else 5  # 5: none collected
        collector.save()
        part.set(exit_code=code)
        counts = collector.counts()
        if code not in (0, 5) or counts["failed"] or counts["error"] or collector.collect_errors:
            raise RuntimeError(f"pytest exit code {code}: {counts}")


if __name__ == "__main__":
    main()
