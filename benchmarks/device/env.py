"""(0) The environment, first and in seconds: what the lent machine runs, and whether the pieces
the suite needs import there.

    python -m benchmarks.device.env --out env.json [--smoke] [--quick] [--budget S]

Records the date, the commit (`LEYLINE_COMMIT` over git's, as the summary), Python, the versions
of jax, jaxlib, flax, numpy, torch and transformers beside the project's pins (pyproject.toml:
the code runs on the pinned jax 0.10.2 and on jax 0.11.x, `SUPPORTED_JAX`), jax's CUDA plugins,
the GPUs (`nvidia-smi`: name, driver, CUDA version, memory), what jax sees (platform, device
kind and count, its backend's version; whether a jitted program runs and gives the right
answer; whether the Mosaic GPU kernels are taken there, `pallas_kernels.dispatch.hopper`) and
torch's CUDA. Then imports, one by one, the pinned libraries and the kernels' jax APIs
(`PIECES`) and each part's own module with what it imports later (`PART_NEEDS`), recording each
failure's error and the parts it stops. The JSON is written after the imports (so a hang in
the device's start still leaves them) and again at the end; a report is printed (run.sh shows
it before any other part runs).

Status "ok" when every import succeeds and the jitted program runs right, else "failed" with
the failures named; run.sh still runs every part (one whose imports fail fails on its own, in
seconds). Imports that need jax come after jax's own: the device's memory is not preallocated
here (this process only looks).
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import time
import tomllib
import traceback
from pathlib import Path

from benchmarks.device.report import Part, parser
from benchmarks.device.summary import PACKAGES, git_commit

ROOT = Path(__file__).resolve().parents[2]
SUPPORTED_JAX = ("0.10.2", "0.11.")  # the pin, and the device image's minor release (a prefix)
# The pinned libraries and the jax APIs the kernels are written against, checked before the
# parts' modules so that a failure names the piece, not only the part ("module:attribute": the
# attribute must exist too).
PIECES = (
    "jax",
    "jaxlib",
    "flax.nnx",
    "jax.experimental.pallas",
    "jax.experimental.pallas.mosaic_gpu",
    "jax.experimental.pallas.tpu",
    "pallas_kernels.ragged_paged_attention",
    "pallas_kernels.splice_rotate",
    "leyline_jax",
    "leyline_jax.paged",
    "leyline_jax.splice",
    "torch",
    "transformers:DeepseekV2Config",
    "pytest",
)
# What each part imports (its module first); a part any of whose imports fails cannot run
PART_NEEDS = {
    "splice": ("benchmarks.device.splice",),
    "attention": ("benchmarks.device.attention",),
    "hf": ("benchmarks.device.hf", "torch", "transformers:DeepseekV2Config"),
    "model": ("benchmarks.device.model",),
    "edit": ("benchmarks.device.edit",),
    "kernels": ("benchmarks.device.kernels", "pytest", "hypothesis"),
}
CUDA_DISTS = ("jax-cuda", "jax_cuda", "nvidia-cudnn", "nvidia-cuda-runtime", "nvidia-nccl")


def try_import(spec: str) -> dict:
    """{"module": spec, "ok", "seconds", "error": the exception and its last frames or None}."""
    name, _, attr = spec.partition(":")
    t0 = time.monotonic()
    try:
        module = importlib.import_module(name)
        if attr:
            getattr(module, attr)
        error = None
    except BaseException as e:  # noqa: BLE001  (an import may fail any way: recorded)
        if isinstance(e, KeyboardInterrupt):
            raise
        tail = "".join(traceback.format_exception(e)[-3:])
        error = f"{type(e).__name__}: {e}"[:500] + "\n" + tail[-1500:]
    return dict(module=spec, ok=error is None, seconds=time.monotonic() - t0, error=error)


def imports() -> dict:
    """Every piece and every part's needs imported once, in order: {"checked": [...],
    "failed": [modules], "parts_blocked": {part: [its failed imports]}}."""
    checked: dict[str, dict] = {}
    for spec in (*PIECES, *(s for needs in PART_NEEDS.values() for s in needs)):
        if spec not in checked:
            checked[spec] = try_import(spec)
    failed = [s for s, r in checked.items() if not r["ok"]]
    blocked = {
        part: bad
        for part, needs in PART_NEEDS.items()
        if (bad := [s for s in needs if s in failed])
    }
    return dict(checked=list(checked.values()), failed=failed, parts_blocked=blocked)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def pins() -> dict:
    """{package: {"pinned", "installed", "matches"}} for the `==` pins of pyproject.toml among
    `PACKAGES`, and whether the installed jax is one the code runs on (`SUPPORTED_JAX`)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    out = {}
    for spec in specs:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;,]+)\s*", spec)
        if m and m.group(1).lower() in PACKAGES:
            installed = _version(m.group(1))
            public = (installed or "").split("+")[0]  # a local label (torch's "+cpu") aside
            out[m.group(1).lower()] = dict(
                pinned=m.group(2), installed=installed, matches=public == m.group(2)
            )
    jax = _version("jax") or ""
    supported = any(jax == v if not v.endswith(".") else jax.startswith(v) for v in SUPPORTED_JAX)
    return dict(packages=out, jax_supported=supported, supported_jax=list(SUPPORTED_JAX))


def cuda_dists() -> dict:
    """Versions of jax's CUDA plugins and the NVIDIA runtime wheels installed."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(CUDA_DISTS):
            found[name] = dist.version
    return dict(sorted(found.items()))


def nvidia_smi() -> dict | None:
    """GPUs as the driver sees them (None where there is no nvidia-smi)."""
    query = "name,driver_version,memory.total,compute_cap"
    try:
        rows = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        head = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None if isinstance(e, FileNotFoundError) else dict(error=str(e)[:300])
    fields = query.split(",")
    gpus = [
        dict(zip(fields, map(str.strip, r.split(",")), strict=False))
        for r in rows.strip().splitlines()
        if r.strip()
    ]
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", head)
    return dict(gpus=gpus, cuda_version=cuda.group(1) if cuda else None)


def jax_view() -> dict:
    """What jax sees and whether a jitted program runs right there."""
    import jax
    import jax.numpy as jnp

    d = jax.devices()[0]
    view = dict(platform=d.platform, device_kind=d.device_kind, device_count=jax.device_count())
    view["platform_version"] = getattr(d.client, "platform_version", None)
    t0 = time.monotonic()
    got = jax.jit(lambda x: x * 2 + 1)(jnp.arange(4.0)).tolist()
    view |= dict(jit_ok=got == [1.0, 3.0, 5.0, 7.0], jit_seconds=time.monotonic() - t0)
    try:
        from pallas_kernels.dispatch import hopper

        view["mosaic_gpu_kernels"] = d.platform == "gpu" and hopper()
    except Exception as e:  # noqa: BLE001  (recorded: the imports above say why)
        view["mosaic_gpu_kernels"] = f"error: {type(e).__name__}: {e}"[:300]
    return view


def torch_view() -> dict:
    import torch

    view = dict(torch=torch.__version__, cuda=torch.version.cuda)
    view["cuda_available"] = torch.cuda.is_available()
    view["device_count"] = torch.cuda.device_count() if view["cuda_available"] else 0
    if view["cuda_available"]:
        view["name"] = torch.cuda.get_device_name(0)
    return view


def headline(data: dict) -> list[str]:
    """The report's lines: machine and versions, then every failed import."""
    smi, view = data.get("nvidia_smi") or {}, data.get("jax") or {}
    gpus = smi.get("gpus") or []
    if gpus:
        gpu = f"{gpus[0].get('name')} x{len(gpus)} (driver {gpus[0].get('driver_version')}, "
        gpu += f"CUDA {smi.get('cuda_version')})"
    else:
        gpu = "no NVIDIA GPU (nvidia-smi: none)"
    packages = data["pins"]["packages"]
    versions = ", ".join(
        f"{k} {v['installed']}" + ("" if v["matches"] else f" (pin {v['pinned']})")
        for k, v in packages.items()
    )
    lines = [
        f"environment: {data['date']}, commit {(data.get('git') or {}).get('commit')}",
        f"machine: {gpu}; jax sees {view.get('device_count')} x {view.get('device_kind')} "
        f"({view.get('platform')}, {view.get('platform_version')}); jit ok: "
        f"{view.get('jit_ok')}; Mosaic GPU kernels taken: {view.get('mosaic_gpu_kernels')}",
        f"versions: {versions}; jax supported: {data['pins']['jax_supported']} "
        f"({', '.join(v + ('x' if v.endswith('.') else '') for v in SUPPORTED_JAX)})",
    ]
    imp = data["imports"]
    lines.append(f"imports: {len(imp['checked']) - len(imp['failed'])} of {len(imp['checked'])} ok")
    for r in imp["checked"]:
        if not r["ok"]:
            lines.append(f"IMPORT FAILED: {r['module']}: {r['error'].splitlines()[0]}")
    for part, bad in imp["parts_blocked"].items():
        lines.append(f"PART CANNOT RUN: {part} (needs {', '.join(bad)})")
    return lines


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # this process only looks
    with Part("env", args) as part:
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        part.set(date=now, git=git_commit(), python=sys.version.split()[0])
        part.set(platform=platform.platform(), pins=pins(), cuda_dists=cuda_dists())
        part.set(imports=imports())
        part.set(nvidia_smi=nvidia_smi())
        problems = [f"import failed: {m}" for m in part.data["imports"]["failed"]]
        for name, look in (("jax", jax_view), ("torch", torch_view)):
            try:
                part.set(**{name: look()})
            except Exception as e:  # noqa: BLE001  (recorded: the suite goes on)
                part.set(**{name: dict(error=f"{type(e).__name__}: {e}"[:500])})
                problems.append(f"{name}: {type(e).__name__}")
        view = part.data["jax"]
        if "error" not in view and not view["jit_ok"]:
            problems.append("a jitted program gave a wrong answer")
        if not args.smoke and view.get("platform") == "cpu":
            problems.append("jax sees no accelerator (platform cpu)")
        part.set(problems=problems)
        lines = headline(part.data)
        part.set(report=lines)
        print("\n".join(lines), flush=True)
        if problems:
            raise RuntimeError("; ".join(problems))


if __name__ == "__main__":
    main()
