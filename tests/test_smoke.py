import jax
import jax.numpy as jnp

import sparsejax as sj


def test_dropless_matches_reference_smoke():
  x = jax.random.normal(jax.random.key(0), (37, 8))
  r = sj.top_k_routing(jax.random.normal(jax.random.key(1), (37, 4)), 2)
  w_in = jax.random.normal(jax.random.key(2), (4, 8, 16))
  w_out = jax.random.normal(jax.random.key(3), (4, 16, 8))
  y, stats = sj.moe_mlp(x, r.expert_ids, r.combine_weights, w_in, w_out)
  y_ref = sj.moe_mlp_reference(x, r.expert_ids, r.combine_weights, w_in, w_out)
  assert jnp.allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  assert int(stats.tokens_per_expert.sum()) == 37 * 2
