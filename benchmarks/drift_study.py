"""Rotation drift: k_pe after many successive splices, against exact float64 RoPE.

    python -m benchmarks.drift_study [--keys 2048] [--out drift.json]

Keys x (float64, Dr = 64, DeepSeek's rope width; theta 10000) are embedded at random positions,
then moved by N successive random splices (Δ uniform in [-1024, 1024], positions kept in
[0, 100000)). After N = 1, 10, 100, 1000 splices the cached band is compared with exact float64
RoPE of x at the final position: relative L2 error ||k - ref|| / ||ref|| over all keys. Three
arms:

- `bf16 store, fp32 math`: bf16 storage; each splice rotates in fp32 (the splice kernel's
  path: `pallas_kernels.splice_rotate_ref`) and rounds once to bf16.
- `bf16 math`: bf16 storage and the rotation itself computed in bf16 (cos/sin and products).
- `fp32 store, fp32 math`: `k_pe` stored in fp32 (selectable with `init_state(k_pe_dtype=...)`).

Beside each: the error a fresh prefill at the final position would have in the same storage
(the floor a splice cannot beat). A second table compares the two ways to compute one rotation
at long positions: θ(new) − θ(old) from fp32 phases (what the kernel does; matches what a fresh
prefill caches) against Δ · inv_freq.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from pallas_kernels.splice_rotate import splice_rotate_ref

DR = 64
THETA = 10000.0
CHECKPOINTS = (1, 10, 100, 1000)
MAX_POS = 100_000


def _rotate(x, cos, sin, xp=np):
    """`x` (halves layout) rotated by the angles whose cosines and sines are given."""
    h = x.shape[-1] // 2
    return xp.concatenate([x[:, :h] * cos - x[:, h:] * sin, x[:, h:] * cos + x[:, :h] * sin], -1)


def inv_freq32() -> np.ndarray:
    exponents = np.arange(0, DR, 2, dtype=np.float32) / np.float32(DR)
    return (1.0 / THETA**exponents).astype(np.float32)


def rope64(x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Exact float64 RoPE (halves layout) with float64 phases."""
    ph = pos.astype(np.float64)[:, None] * (1.0 / THETA ** (np.arange(0, DR, 2) / DR))
    return _rotate(x, np.cos(ph), np.sin(ph))


def embed_fp32(x: np.ndarray, pos: np.ndarray, dtype) -> jnp.ndarray:
    """What a fresh prefill caches: fp32 phases, fp32 math, cast to storage."""
    ph = pos.astype(np.float32)[:, None] * inv_freq32()
    return jnp.asarray(_rotate(x.astype(np.float32), np.cos(ph), np.sin(ph)), dtype)


def _rel_l2(k, ref) -> float:
    k = np.asarray(jnp.asarray(k, jnp.float32), np.float64)
    return float(np.linalg.norm(k - ref) / np.linalg.norm(ref))


@jax.jit
def _step_fp32_math(k, pos_from, pos_to, inv):
    c = jnp.zeros((1, k.shape[0], 1), jnp.float32)
    idx = jnp.arange(k.shape[0])
    _, out = splice_rotate_ref(c, k[None], idx, idx, pos_from, pos_to, inv)
    return out[0]


@jax.jit
def _step_bf16_math(k, pos_from, pos_to, inv):
    bf = jnp.bfloat16
    a = (pos_from.astype(jnp.float32)[:, None] * inv).astype(bf)
    b = (pos_to.astype(jnp.float32)[:, None] * inv).astype(bf)
    cos = jnp.cos(b) * jnp.cos(a) + jnp.sin(b) * jnp.sin(a)
    sin = jnp.sin(b) * jnp.cos(a) - jnp.cos(b) * jnp.sin(a)
    return _rotate(k.astype(bf), cos, sin, jnp).astype(k.dtype)


ARMS = {
    "bf16 store, fp32 math": (jnp.bfloat16, _step_fp32_math),
    "bf16 math": (jnp.bfloat16, _step_bf16_math),
    "fp32 store, fp32 math": (jnp.float32, _step_fp32_math),
}


def drift(keys: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((keys, DR))
    pos0 = rng.integers(0, MAX_POS, keys)
    inv = jnp.asarray(inv_freq32())
    rows = []
    for arm, (dtype, step) in ARMS.items():
        k = embed_fp32(x, pos0, dtype)
        pos = pos0.copy()
        done = 0
        for n in CHECKPOINTS:
            for _ in range(n - done):
                delta = rng.integers(-1024, 1025, keys)
                new = np.clip(pos + delta, 0, MAX_POS - 1)
                k = step(k, jnp.asarray(pos, jnp.int32), jnp.asarray(new, jnp.int32), inv)
                pos = new
            done = n
            ref = rope64(x, pos)
            fresh = _rel_l2(embed_fp32(x, pos, dtype), ref)
            err = _rel_l2(k, ref)
            rows.append(dict(arm=arm, splices=n, rel_l2=err, fresh_prefill_rel_l2=fresh))
    return rows


def phase_methods(keys: int, seed: int) -> list[dict]:
    """One move p -> p + Δ, fp32 storage: θ(new) - θ(old) vs Δ * inv_freq, against what a fresh
    fp32 prefill at p + Δ caches and against exact float64 RoPE."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((keys, DR))
    inv = inv_freq32()
    rows = []
    for base in (100, 4_000, 32_000, 100_000):
        pos = np.full(keys, base)
        delta = rng.integers(-1024, 1025, keys)
        new = pos + delta
        k = embed_fp32(x, pos, jnp.float32)
        pos32, new32 = jnp.asarray(pos, jnp.int32), jnp.asarray(new, jnp.int32)
        by_phase = _step_fp32_math(k, pos32, new32, jnp.asarray(inv))
        ang = (delta.astype(np.float32)[:, None] * inv).astype(np.float32)
        by_delta = _rotate(np.asarray(k), np.cos(ang), np.sin(ang))
        fresh = np.asarray(embed_fp32(x, new, jnp.float32), np.float64)
        exact = rope64(x, new)
        refs = {"fresh": fresh, "exact": exact}
        ways = {"phase_diff": by_phase, "delta_inv": by_delta}
        errors = {f"{w}_vs_{r}": _rel_l2(y, z) for r, z in refs.items() for w, y in ways.items()}
        rows.append(dict(position=base, **errors, fresh_vs_exact=_rel_l2(fresh, exact)))
    return rows


def main(argv=None) -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--keys", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rows = drift(args.keys, args.seed)
    errors = ("rel_l2", "fresh_prefill_rel_l2")
    cells = [[r["arm"], str(r["splices"]), *(f"{r[k]:.3e}" for k in errors)] for r in rows]
    print("\n".join(harness.table(["arm", "splices", "rel L2 vs exact", "fresh prefill"], cells)))
    phases = phase_methods(args.keys, args.seed)
    header = ["position", "θ-diff vs fresh", "Δ·inv vs fresh", "θ-diff vs exact"]
    header += ["Δ·inv vs exact", "fresh vs exact"]
    cells = [[str(r["position"]), *(f"{r[k]:.3e}" for k in list(r)[1:])] for r in phases]
    print("\n".join(["", *harness.table(header, cells, "r" * 6)]))
    harness.save_json(args.out, {"drift": rows, "phase_methods": phases})


if __name__ == "__main__":
    main()
