"""`python -m serve.traces`: the trace generator's command line under its old name. The code
lives in `benchmarks.traces`; its names are re-exported here for the old importers."""

from benchmarks.traces import *  # noqa: F403
from benchmarks.traces import main

if __name__ == "__main__":
    main()
