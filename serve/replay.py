"""`python -m serve.replay`: the replay benchmark's command line under its old name. The code
lives in `benchmarks.replay`; its names are re-exported here for the old importers."""

from benchmarks.replay import *  # noqa: F403
from benchmarks.replay.__main__ import KEYS, main, markdown, plot  # noqa: F401

if __name__ == "__main__":
    main()
