"""The ragged expert-parallel exchange on real GPUs (XLA:CPU has no ragged-all-to-all, so the CPU
suite runs its dense emulation instead): jax.lax.ragged_all_to_all against that emulation, and the
expert-parallel layer with each exchange against the single-device layer, values and gradients.

  JAX_PLATFORMS=cuda python -m pytest -q tests_gpu/test_exchange_compiled.py   # 2 or more GPUs
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax as sj
from sparsejax import exchange, mesh as meshlib, parallel
from sparsejax.parallel import ExpertParallelConfig

# Off a GPU, conftest.py stops the run. On one GPU only this file is out of reach: it skips, so
# `pytest tests_gpu` still runs the kernel tests there.
if jax.device_count() < 2:
  pytest.skip(f"the exchange needs 2 or more GPUs; this machine has {jax.device_count()}", allow_module_level=True)

N = jax.device_count()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_all_to_all_rows_equals_the_emulation(dtype):
  mesh = meshlib.make_expert_mesh(1, N)
  layout = meshlib.expert_layout(mesh, N)
  slots, d = 40, 24
  rng = np.random.default_rng(0)
  sizes = rng.integers(0, slots + 1, (N, N)).astype(np.int32)  # sizes[i, j]: rows i sends j
  sizes[0, :] = 0  # a device that sends nothing
  sizes[:, 1] = slots  # a full block to every peer of device 1
  buf = rng.normal(size=(N, N, slots, d)).astype(np.float32)
  buf[np.arange(slots)[None, None, :] >= sizes[:, :, None]] = 0.0  # rows past a block's size are zeros
  spec = jax.sharding.PartitionSpec(meshlib.EXPERT)

  def body(b, send, recv, *, emulate):
    return exchange.ragged_all_to_all_rows(b[0], send[0], recv[0], layout, emulate=emulate)[None]

  args = (jnp.asarray(buf, dtype), jnp.asarray(sizes), jnp.asarray(sizes.T.copy()))
  run = lambda emulate: jax.jit(parallel._shard_map(functools.partial(body, emulate=emulate), mesh,
                                                    (spec,) * 3, spec, check=False))(*args)
  got, want = run(False), run(True)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  # And the dense all-to-all of the zero-padded blocks: the same result.
  dense = jax.jit(parallel._shard_map(lambda b: exchange.dense_all_to_all(b[0], layout, False)[None],
                                      mesh, (spec,), spec))(args[0])
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(dense, np.float32))


@pytest.mark.parametrize("kind", ["uniform", "one"])
def test_layer_with_each_exchange_matches_one_device(kind):
  t, d, f, e, k = 256 * N, 64, 128, 4 * N, 2
  ks = jax.random.split(jax.random.key(0), 5)
  logits = jax.random.normal(ks[0], (t, e))
  if kind == "one":
    logits = logits.at[:, e - 1].add(100.0)  # every token's first choice on the last device's expert
  r = sj.top_k_routing(logits, k)
  x = jax.random.normal(ks[1], (t, d))
  w_in = jax.random.normal(ks[2], (e, d, f)) / np.sqrt(d)
  w_out = jax.random.normal(ks[3], (e, f, d)) / np.sqrt(f)
  g = jax.random.normal(ks[4], (t, d))
  mesh = meshlib.make_expert_mesh(1, N)

  def value_and_grads(layer):
    loss = lambda x, cw, w_in, w_out: jnp.sum(layer(x, r.expert_ids, cw, w_in, w_out)[0] * g)
    with jax.default_matmul_precision("highest"):
      return jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))(x, r.combine_weights, w_in, w_out)

  want = value_and_grads(sj.moe_mlp)
  # "auto" is the ragged exchange from RAGGED_FROM_PEERS GPUs up, the dense one below.
  assert exchange.resolve_exchange("auto", False, num_peers=N, platform=jax.devices()[0].platform) == (
      "ragged" if N >= exchange.RAGGED_FROM_PEERS else "dense")
  configs = {}
  for dispatch in ("assignments", "tokens"):  # a row an assignment, or a row a token and peer
    configs.update({f"{ex}, {dispatch}": ExpertParallelConfig(exchange=ex, dispatch=dispatch)
                    for ex in ("ragged", "dense", "auto")})  # compact send
    configs[f"ragged, block send, {dispatch}"] = ExpertParallelConfig(exchange="ragged", compact_send=False,
                                                                     dispatch=dispatch)
    for f in (1.0, 1.5):  # a buffer of f times the mean: the "one" routing overflows it (the fallback, remat)
      configs[f"auto, buffer {f}x, {dispatch}"] = ExpertParallelConfig(dispatch=dispatch, buffer_factor=f)
  for ex, config in configs.items():
    got = value_and_grads(functools.partial(parallel.expert_parallel_moe_mlp, mesh=mesh, parallel=config))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=ex)
