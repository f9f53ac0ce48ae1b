"""The full-attention kind's decode attention forms against each other."""

import jax
import numpy as np

from rpegjax.models.full_attention import attend_pages, cached_attention


def test_decode_attention_over_gathered_pages_equals_the_contiguous_attention():
    """`attend_pages` (one token per row over [k b w n e] pages, the pool's layout) == `cached_attention` over the
    same keys laid out as the contiguous cache's (keys [b k e w*n], values [b k w*n e]), with each row's query at a
    different cache index (later keys masked)."""
    b, w, kv, n, e, g = 3, 4, 2, 5, 8, 2
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, 1, kv * g, e))
    pages_k, pages_v = (jax.random.normal(k, (kv, b, w, n, e)) for k in keys[1:])
    positions = np.array([[0], [7], [w * n - 1]], np.int32)
    flat_v = pages_v.transpose(1, 0, 2, 3, 4).reshape(b, kv, w * n, e)
    flat_k = pages_k.transpose(1, 0, 4, 2, 3).reshape(b, kv, e, w * n)
    np.testing.assert_allclose(attend_pages(q, pages_k, pages_v, positions),
                               cached_attention(q, flat_k, flat_v, positions), atol=1e-5, rtol=0)
