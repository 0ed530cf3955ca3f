"""One part's JSON result file, the command line every part shares, and markdown tables (no jax,
no torch: the summary and the tables are written even where jax does not import).

A part's file is rewritten after every row it measures, so a part that its time budget kills
still leaves what it had measured (status "running": the summary then reports a timeout).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback


def clean(x):
    """`x` with every non-finite float replaced by None: strict JSON, and no NaN for a reader
    to mistake for a number."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


def write_json(path: str, data) -> None:
    """Write atomically (a reader never sees half a file, even if the writer is killed)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(clean(data), f, indent=1, allow_nan=False)
    os.replace(tmp, path)


def read_json(path: str):
    """A result file's data (None where there is no such file)."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def parser(description: str) -> argparse.ArgumentParser:
    """The arguments every part takes (run.sh passes them); a part may add its own."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True, help="the part's JSON file")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU (CI)")
    ap.add_argument("--quick", action="store_true", help="the targets' rows, fewer repeats")
    ap.add_argument(
        "--budget", type=float, default=600.0, help="seconds run.sh allows this part (timeout)"
    )
    return ap


class Part:
    """Context manager around one part's run: status "running" until the body returns ("ok",
    or "partial" when rows were skipped to stay inside the budget) or raises ("failed", with the
    traceback's tail; the exception propagates, so the process exits non-zero)."""

    def __init__(self, name: str, args: argparse.Namespace):
        self.path, self.budget, self.smoke = args.out, args.budget, args.smoke
        self.t0 = time.monotonic()
        quick = getattr(args, "quick", False)
        self.data = dict(part=name, status="running", smoke=args.smoke, quick=quick)
        self.data |= dict(budget_s=args.budget)
        self.data |= dict(elapsed_s=0.0, rows=[], skipped=[], error=None)

    def __enter__(self) -> Part:
        self.write()
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.data["status"] = "partial" if self.data["skipped"] else "ok"
        else:
            self.data["status"] = "failed"
            self.data["error"] = "".join(traceback.format_exception(kind, value, tb))[-4000:]
        self.write()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def out_of_time(self, fraction: float = 0.7) -> bool:
        """Past `fraction` of the budget: the next measurement might not finish, so skip it and
        keep what is done (a measurement cannot be interrupted halfway, a compile least). Never
        in the smoke, which exists to run every row (its timeout still stops a hang)."""
        return not self.smoke and self.elapsed() > fraction * self.budget

    def each(self, sizes, what: str):
        """The sizes still in time (`out_of_time`), in order; each one past it is skipped,
        named by `what.format(size)`."""
        for size in sizes:
            if self.out_of_time():
                self.skip(f"{what.format(size)}: out of time")
                continue
            yield size

    def set(self, **fields) -> None:
        self.data.update(fields)
        self.write()

    def add(self, row: dict) -> None:
        self.data["rows"].append(row)
        self.write()

    def skip(self, what: str) -> None:
        self.data["skipped"].append(what)
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = self.elapsed()
        write_json(self.path, self.data)


# ---- markdown -----------------------------------------------------------------------------------
def table(header: list[str], rows, align: str | None = None) -> list[str]:
    """The lines of a markdown table: `header`, then a line per row (cells already formatted as
    strings). `align`: a letter per column, "l" or "r" (default: the first left, the rest
    right)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return ["| " + " | ".join(header) + " |", rule, *("| " + " | ".join(r) + " |" for r in rows)]


def section(caption: str, header: list[str], rows, align: str | None = None) -> list[str]:
    """One part of a markdown report: a blank line, `caption`, a blank line, the table."""
    return ["", caption, "", *table(header, rows, align)]
