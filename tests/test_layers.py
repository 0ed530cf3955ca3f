"""`leyline_jax.layers.matmul` / `einsum`: bf16 products with f32 accumulation, as a plain
product means, and the output order XLA:CPU's bf16 GEMM needs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from leyline_jax.layers import einsum, matmul


@pytest.mark.parametrize("rows", [(), (1,), (2,), (3, 5), (0,)])
def test_bf16_matmul_is_the_f32_product_rounded_once(rows):
    rng = np.random.default_rng(len(rows))
    x = jnp.asarray(rng.standard_normal((*rows, 96)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((96, 40)), jnp.bfloat16)
    got = jax.jit(matmul)(x, w)
    assert got.dtype == jnp.bfloat16 and got.shape == (*rows, 40)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    # one rounding of an f32 sum: within a bf16 unit of the float64 product
    np.testing.assert_allclose(np.asarray(got, np.float64), exact, rtol=2**-8, atol=1e-6)
    # a product rounded to bf16 at every partial sum would not be (shown to fail)
    step = x.astype(jnp.float32)[..., :, None] * w.astype(jnp.float32)
    partial = np.zeros((*rows, 40), np.float32)
    for k in range(96):
        summed = jnp.asarray(partial + np.asarray(step[..., k, :]))
        partial = np.asarray(summed.astype(jnp.bfloat16))
    if exact.size:
        with pytest.raises(AssertionError):
            np.testing.assert_allclose(partial, exact, rtol=2**-8, atol=1e-6)


def test_f32_matmul_is_unchanged():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((4, 7, 16)), rng.standard_normal((16, 8))
    x, w = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
    np.testing.assert_array_equal(np.asarray(matmul(x, w)), np.asarray(x @ w))


def test_einsum_takes_only_dot_general_order():
    a = jnp.ones((4, 3, 5), jnp.bfloat16)
    b = jnp.ones((5, 16), jnp.bfloat16)
    assert einsum("nts,sr->ntr", a, b).shape == (4, 3, 16)
    assert einsum("ntd,ndr->ntr", a, jnp.ones((4, 5, 2), jnp.bfloat16)).shape == (4, 3, 2)
    with pytest.raises(ValueError, match=r"nts,sr->tnr.*\(ntr\)"):
        einsum("nts,sr->tnr", a, b)
