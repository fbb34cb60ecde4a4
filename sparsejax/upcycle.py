"""Sparse upcycling (Komatsuzaki et al. 2023): start an MoE model from a trained dense one.

Every MoE layer's experts start as copies of that layer's dense MLP and its router starts fresh;
every other parameter is copied. With top-1 routing and renormalized weights (combine weight 1) the
upcycled model computes exactly the dense function at step 0; training then lets experts diverge.
"""
from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
from flax import nnx

from sparsejax.checkpoint import Checkpointer
from sparsejax.models import Transformer, TransformerConfig

# Fields that must agree for the dense weights to fit the MoE model.
SHARED_FIELDS = ("d_model", "num_layers", "num_heads", "d_ff", "vocab_size", "glu", "activation", "param_dtype",
                 "rope_base")  # rope_base: the positions the dense weights were trained with


def upcycle_config(dense: TransformerConfig, *, num_experts: int = 8, top_k: int = 1, moe_every: int = 2,
                   renormalize: bool | None = True, **changes) -> TransformerConfig:
  """The MoE twin of a dense config: MoE every `moe_every` blocks (Switch: 2), weights renormalized."""
  return dense.replace(moe_every=moe_every, num_experts=num_experts, top_k=top_k,
                       renormalize=renormalize, **changes)


def upcycle_params(dense_params: dict, dense_cfg: TransformerConfig, moe_cfg: TransformerConfig,
                   *, seed: int = 0) -> dict:
  """MoE params (pure dict): W_in[e] = W_in, W_gate[e] = W_gate, W_out[e] = W_out for every e, fresh router."""
  for name in SHARED_FIELDS:
    if getattr(dense_cfg, name) != getattr(moe_cfg, name):
      raise ValueError(f"Cannot upcycle: dense {name}={getattr(dense_cfg, name)!r} but MoE "
                       f"{name}={getattr(moe_cfg, name)!r}.")
  fresh = nnx.to_pure_dict(nnx.state(Transformer(moe_cfg, rngs=nnx.Rngs(seed))))
  params = jax.tree.map(jnp.asarray, dense_params)  # a copy whose structure we then edit
  for i in range(moe_cfg.num_layers):
    if not moe_cfg.is_moe_layer(i):
      continue
    if dense_cfg.is_moe_layer(i):
      raise ValueError(f"Cannot upcycle: block {i} of the source model is already an MoE layer.")
    dense_ffn, moe_ffn = params["blocks"][i]["ffn"], dict(fresh["blocks"][i]["ffn"])
    for w in ("w_in", "w_gate", "w_out"):
      if w in moe_ffn:
        moe_ffn[w] = jnp.broadcast_to(dense_ffn[w][None], moe_ffn[w].shape).astype(moe_ffn[w].dtype)
    params["blocks"][i]["ffn"] = moe_ffn  # router: the fresh one
  return params


def upcycle(dense_model: Transformer, moe_cfg: TransformerConfig, *, seed: int = 0) -> Transformer:
  """A Transformer of moe_cfg holding the upcycled weights of dense_model."""
  params = upcycle_params(nnx.to_pure_dict(nnx.state(dense_model)), dense_model.cfg, moe_cfg, seed=seed)
  model = Transformer(moe_cfg, rngs=nnx.Rngs(seed))
  state = nnx.state(model)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  return model


def load_dense_and_upcycle(path: str | pathlib.Path, moe_cfg: TransformerConfig, *, seed: int = 0) -> Transformer:
  """Upcycle the latest checkpoint of a dense run (its out dir or its checkpoints dir)."""
  path = pathlib.Path(path)
  if (path / "checkpoints").is_dir():
    path = path / "checkpoints"
  if not path.is_dir():
    raise FileNotFoundError(f"No dense run to upcycle at {str(path)!r}.")
  ckpt = Checkpointer(path)
  dense_cfg = TransformerConfig.from_dict(ckpt.restore_meta()["model_config"])
  dense = Transformer(dense_cfg, rngs=nnx.Rngs(0))
  items, _ = ckpt.restore({"params": nnx.to_pure_dict(nnx.state(dense))})
  ckpt.close()
  state = nnx.state(dense)
  nnx.replace_by_pure_dict(state, items["params"])
  nnx.update(dense, state)
  return upcycle(dense, moe_cfg, seed=seed)
