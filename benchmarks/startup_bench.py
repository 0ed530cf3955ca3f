"""What one step shape costs to trace and compile, by depth: SmolLM2-135M's width (its GGUF's
config) at 8, 30 and 60 layers, each depth in a fresh process (no compiled program carried
over), zero weights (a program's compile time does not depend on the values).

Per depth: `prefill` is the first `ll.prefill` of 16 tokens (trace + compile + run) less a
second one of the same shape on another sequence (run only); `decode` likewise for the first
one-token `ll.decode` of one row. Uses the public API only, so the same command measures any
tree (`--root` a checkout of it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

DEPTHS = (8, 30, 60)


def one(layers: int) -> dict:
    """Run in a fresh process: the costs of one depth (seconds)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import leyline_jax as ll
    from leyline_jax import gguf
    from leyline_jax.loader import config_from_hf
    from leyline_jax.model import CausalLM

    hf = gguf.read_gguf(gguf.smollm2_path())[0] | {"num_hidden_layers": layers}
    model = CausalLM(config_from_hf(hf), jnp.float32)
    state = ll.init_state(model.config, num_pages=64, page_size=16, max_seqs=4)
    toks = np.arange(1, 17, dtype=np.int32)

    def clock(fn):
        t = time.perf_counter()
        out = fn()
        jax.block_until_ready(out[1])
        return out[0], time.perf_counter() - t

    state, first = clock(lambda: ll.prefill(model, state, 0, toks))
    state, again = clock(lambda: ll.prefill(model, state, 1, toks))
    state, d_first = clock(lambda: ll.decode(model, state, [0], [1]))
    state, d_again = clock(lambda: ll.decode(model, state, [1], [1]))
    return {"layers": layers, "prefill": first - again, "decode": d_first - d_again}


def main() -> None:
    if sys.argv[1:2] == ["--one"]:  # a depth's own process, importing the measured tree only
        print(json.dumps(one(int(sys.argv[2]))))
        return
    from benchmarks import harness

    ap = harness.parser(__doc__)
    ap.add_argument("--depths", default=",".join(map(str, DEPTHS)))
    ap.add_argument("--root", default=".", help="the checkout whose code is measured")
    args = ap.parse_args()
    rows = []
    for layers in map(int, args.depths.split(",")):
        root = os.path.abspath(args.root)
        cmd = [sys.executable, os.path.abspath(__file__), "--one", str(layers)]
        env = os.environ | {"PYTHONPATH": root}
        out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        if out.returncode:
            sys.exit(out.stderr)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]
    print(harness.platform())
    for line in harness.table(
        ["layers", "prefill shape (s)", "x first", "decode shape (s)", "x first"],
        [
            [str(r["layers"]), f"{r['prefill']:.2f}", f"{r['prefill'] / base['prefill']:.2f}",
             f"{r['decode']:.2f}", f"{r['decode'] / base['decode']:.2f}"]
            for r in rows
        ],
    ):  # fmt: skip
        print(line)
    harness.save_json(args.out, {"rows": rows, "root": args.root})


if __name__ == "__main__":
    main()
