"""On a GPU: the ops' "auto" paths with Pallas' Triton backend simulated absent (argv[1] == "absent") or present.

JAX 0.11 deprecated the backend for removal; without it "auto" must take the XLA paths (tests/test_triton_absent.py
checks the choices on the CPU). Here each op runs compiled, forward (and the MoE layer backward), against its XLA
reference, and prints (whether a pallas_call is in its jaxpr, the largest gap); the grouped products and the MoE
layer also print the impl / gmm backend "auto" resolved to. Logs: results/triton_absent_check_{present,absent}_H200.log.

  python experiments/check_triton_absent.py absent      # then: present
"""
import sys

ABSENT = ("jax.experimental.pallas.triton", "jax._src.pallas.triton", "jax._src.pallas.triton.lowering",
          "jax._src.pallas.triton.core", "jax._src.pallas.triton.pallas_call_registration", "jax._src.lib.triton")
if sys.argv[1] == "absent":
  for name in ABSENT:
    sys.modules[name] = None

import warnings
warnings.simplefilter("always", RuntimeWarning)
import jax, jax.numpy as jnp, numpy as np
from sparsejax.kernels import pallas_triton_available, gpu_compute_capability
from sparsejax.grouped_matmul import grouped_matmul, grouped_matmul_reference, resolve_impl
from sparsejax.kernels import decode_attention, decode_qkv, decode_router, row_moves, skinny_matmul, gmm
from sparsejax.kernels.gmm import op as gmm_op
from sparsejax.moe import moe_mlp
from sparsejax.topology import make_topology

print("jax", jax.__version__, jax.default_backend(), gpu_compute_capability(), "triton:", pallas_triton_available())
rng = np.random.default_rng(0)
d = lambda *s, dt=jnp.float32: jnp.asarray(rng.standard_normal(s), dt)
gap = lambda a, b: float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))
pallas = lambda f, *a: "pallas_call" in str(jax.make_jaxpr(f)(*a))
res = {}
q, kc, vc = d(4, 8, 64, dt=jnp.bfloat16), d(4, 256, 8, 64, dt=jnp.bfloat16), d(4, 256, 8, 64, dt=jnp.bfloat16)
st, ix = jnp.zeros((4,), jnp.int32), jnp.int32(100)
f = jax.jit(lambda *a: decode_attention.decode_attention(*a))
res["attention"] = (pallas(f, q, kc, vc, st, ix), gap(f(q, kc, vc, st, ix), decode_attention.decode_attention_reference(q, kc, vc, st, ix)))
parts = d(4, 4, 3 * 8 * 64)
f = jax.jit(lambda *a: decode_qkv.decode_qkv(*a, rope_base=1e4, dtype=jnp.bfloat16))
got, want = f(parts, kc, vc, ix, st), decode_qkv.decode_qkv_reference(parts, kc, vc, ix, st, 1e4, jnp.bfloat16)
res["qkv"] = (pallas(f, parts, kc, vc, ix, st), max(gap(a, b) for a, b in zip(got, want)))
x, w_in, w_out = d(1, 1024, dt=jnp.bfloat16), d(8, 1024, 4096, dt=jnp.bfloat16) * 0.03, d(8, 4096, 1024, dt=jnp.bfloat16) * 0.03
ids = jnp.array([1, 5], jnp.int32)
f = jax.jit(lambda x, a, b, e: skinny_matmul.skinny_ffn(x, a, b, experts=e))
g = jax.jit(lambda x, a, b, e: skinny_matmul.skinny_ffn(x, a, b, experts=e, impl="xla"))
res["skinny_ffn"] = (pallas(f, x, w_in, w_out, ids), gap(f(x, w_in, w_out, ids), g(x, w_in, w_out, ids)))
xr, wr = d(1, 1024), d(1024, 64)
f = jax.jit(lambda x, w: decode_router.decode_router(x, w, 2))
res["router"] = (pallas(f, xr, wr), max(gap(a, b) for a, b in zip(f(xr, wr), decode_router.decode_router_reference(xr, wr, 2, True))))
xs, src = d(64, 1024), jnp.asarray(rng.integers(0, 65, 100), jnp.int32)
f = jax.jit(lambda x, s: row_moves.gather_rows(x, s))
res["gather"] = (pallas(f, xs, src), gap(f(xs, src), row_moves.gather_rows_reference(xs, src)))
for dt in (jnp.bfloat16, jnp.float32):
  lhs, rhs, sizes = d(512, 256, dt=dt), d(4, 256, 384, dt=dt), jnp.array([100, 0, 300, 50], jnp.int32)
  f = jax.jit(lambda l, r, s: grouped_matmul(l, r, s))
  res[f"grouped_matmul_{jnp.dtype(dt).name}"] = (resolve_impl("auto", dt), pallas(f, lhs, rhs, sizes),
                                                 gap(f(lhs, rhs, sizes), grouped_matmul_reference(lhs, rhs, sizes)))
  # The MoE layer: forward and backward, against impl="ragged_dot"; the impl it resolves with its dtype.
  xm, e, c = d(256, 256, dt=dt), jnp.asarray(rng.integers(0, 8, (256, 2)), jnp.int32), jnp.full((256, 2), 0.5)
  wi, wo = d(8, 256, 512, dt=dt) * 0.05, d(8, 512, 256, dt=dt) * 0.05
  loss = lambda impl: jax.jit(jax.value_and_grad(lambda x, a, b: jnp.sum(moe_mlp(x, e, c, a, b, impl=impl)[0].astype(jnp.float32) ** 2), (0, 1, 2)))
  (va, ga), (vb, gb) = loss("auto")(xm, wi, wo), loss("ragged_dot")(xm, wi, wo)
  res[f"moe_{jnp.dtype(dt).name}"] = (resolve_impl("auto", dt), gmm_op.resolve_backend("auto", dt), pallas(loss("auto"), xm, wi, wo),
                                      float(abs(va - vb) / abs(vb)), max(gap(a, b) / float(jnp.max(jnp.abs(b.astype(jnp.float32)))) for a, b in zip(ga, gb)))
for k, v in res.items():
  print(k, v)
