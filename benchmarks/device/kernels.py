"""(a) The compiled-kernel tests: `pytest -m accelerator` over tests/, summarised as JSON.

    python -m benchmarks.device.kernels --out kernels.json [--smoke] [--budget S]

Only the test files that mark accelerator tests (`mark.accelerator` in their text) are
collected: the others cannot hold one, and some import packages the device image lacks (the
HTTP server's), which would fail their collection. tests/conftest.py skips accelerator tests
where jax sees no GPU or TPU, so on CPU (the smoke) every one is reported skipped. Status "ok":
no test failed or errored, collection included.
"""

from __future__ import annotations

import pathlib

from benchmarks.device.report import Part, parser

TESTS = pathlib.Path(__file__).resolve().parents[2] / "tests"


class Collector:
    """A pytest plugin keeping each test's outcome (and each failed collection)."""

    def __init__(self):
        self.tests: list[dict] = []
        self.collect_errors: list[dict] = []

    def pytest_runtest_logreport(self, report):
        failed_setup = report.when in ("setup", "teardown") and report.failed
        if report.when == "call" or failed_setup or (report.when == "setup" and report.skipped):
            outcome = "error" if failed_setup else report.outcome
            detail = str(report.longrepr)[-2000:] if report.longrepr else None
            test = dict(test=report.nodeid, outcome=outcome, duration_s=report.duration)
            self.tests.append(test | dict(detail=detail))

    def pytest_collectreport(self, report):
        if report.failed:
            detail = str(report.longrepr)[-2000:]
            self.collect_errors.append(dict(module=report.nodeid, detail=detail))


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    with Part("kernels", args) as part:
        import pytest

        from benchmarks.device.measure import device_info

        part.set(device=device_info())  # what the tests' jax sees: on CPU, everything skips
        files = sorted(p for p in TESTS.glob("test_*.py") if "mark.accelerator" in p.read_text())
        part.set(files=[p.name for p in files])
        collector = Collector()
        args = [*map(str, files), "-m", "accelerator", "-q", "-p", "no:cacheprovider"]
        code = int(pytest.main(args, plugins=[collector])) if files else 5  # 5: none collected
        outcomes = [t["outcome"] for t in collector.tests]
        counts = {k: outcomes.count(k) for k in ("passed", "failed", "skipped", "error")}
        part.set(
            exit_code=code,
            counts=counts,
            collect_errors=collector.collect_errors,
            failures=[t for t in collector.tests if t["outcome"] in ("failed", "error")],
            rows=[{k: t[k] for k in ("test", "outcome", "duration_s")} for t in collector.tests],
        )
        if code not in (0, 5) or counts["failed"] or counts["error"] or collector.collect_errors:
            raise RuntimeError(f"pytest exit code {code}: {counts}")


if __name__ == "__main__":
    main()
