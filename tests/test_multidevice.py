"""The multi-device tests, in their own process: jax fixes its device count when it starts, so
`tests/multidevice` runs under a separate pytest with 8 simulated CPU devices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from serve.http.backend import parse_mesh

HERE = Path(__file__).parent


def test_mesh_suite_passes_on_eight_simulated_devices():
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "LEYLINE_MULTIDEVICE": "1",
    }
    suite = str(HERE / "multidevice")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", suite]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


def test_the_server_mesh_flag_is_checked():
    """`python -m serve.http --mesh DATAxMODEL`: a malformed or oversized mesh is a clear error
    (this process has one device)."""
    assert parse_mesh("1x1").shape == {"data": 1, "model": 1}
    for bad in ("2", "x4", "2x", "axb", "2x4x1"):
        with pytest.raises(ValueError, match="DATAxMODEL"):
            parse_mesh(bad)
    n = jax.device_count() + 1
    with pytest.raises(ValueError, match=f"needs {n} devices"):
        parse_mesh(f"1x{n}")
