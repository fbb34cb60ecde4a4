"""The one config dataclass of the MoE layer."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from sparsejax.activations import ACTIVATIONS
from sparsejax.grouped_matmul import IMPLS

ROUTERS = ("top_k", "expert_choice", "dense_to_sparse")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """d_model -> d_ff -> d_model experts. glu=True gives gated experts (SwiGLU with activation="silu").

  capacity_factor=None is dropless; a float gives the Switch/GShard capacity layer (or, with
  router="expert_choice", the expert-choice capacity). Aux losses are added into MoEStats.aux_loss
  with their weights. The router always runs in float32; dtype is the expert compute dtype.
  token_rounding=True: calls with an rng (training) round each expert's assignments to whole 128-row
  blocks (sparsejax.token_rounding, SonicMoE): no padding rows, some assignments moved, so not
  dropless; calls without one (evaluation, generation) run plain top-k. Top-k router, dropless only.
  Under expert parallelism the devices that send an expert rows round their tokens together.
  """
  d_model: int
  d_ff: int
  num_experts: int = 8
  top_k: int = 1
  router: str = "top_k"
  capacity_factor: float | None = None
  glu: bool = False
  activation: str = "gelu"
  renormalize: bool | None = None
  load_balancing_weight: float = 1e-2
  z_loss_weight: float = 1e-3
  jitter_eps: float = 0.0
  token_rounding: bool = False
  dts_threshold: float = 1e-3
  dts_max_k: int | None = None
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  impl: str = "auto"

  def __post_init__(self):
    for name in ("d_model", "d_ff", "num_experts"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
        raise ValueError(f"MoEConfig.{name} must be a positive int; got {getattr(self, name)!r}.")
    if self.router not in ROUTERS:
      raise ValueError(f"MoEConfig.router must be one of {ROUTERS}; got {self.router!r}.")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"MoEConfig.activation must be one of {tuple(ACTIVATIONS)}; got {self.activation!r}.")
    if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
      raise ValueError(f"MoEConfig.top_k must be an int; got {self.top_k!r}.")
    if self.router == "top_k" and not 1 <= self.top_k <= self.num_experts:
      raise ValueError(f"MoEConfig.top_k must lie in [1, num_experts={self.num_experts}]; got {self.top_k}.")
    for name in ("glu", "renormalize"):
      value = getattr(self, name)
      if not isinstance(value, bool) and not (name == "renormalize" and value is None):
        raise ValueError(f"MoEConfig.{name} must be True or False{' or None' if name == 'renormalize' else ''}; "
                         f"got {value!r}.")
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    for name in ("load_balancing_weight", "z_loss_weight", "jitter_eps", "dts_threshold"):
      if not number(getattr(self, name)):
        raise ValueError(f"MoEConfig.{name} must be a number; got {getattr(self, name)!r}.")
    for name in ("load_balancing_weight", "z_loss_weight"):
      if getattr(self, name) < 0:
        raise ValueError(f"MoEConfig.{name} must be >= 0; got {getattr(self, name)}.")
    for name in ("dtype", "param_dtype"):
      try:
        floating = jnp.issubdtype(jnp.dtype(getattr(self, name)), jnp.floating)
      except TypeError:
        floating = False
      if not floating:
        raise ValueError(f"MoEConfig.{name} must be a floating dtype (e.g. jnp.bfloat16); got {getattr(self, name)!r}.")
    if self.capacity_factor is not None and not number(self.capacity_factor):
      raise ValueError(f"MoEConfig.capacity_factor must be a number or None; got {self.capacity_factor!r}.")
    if self.capacity_factor is not None and not self.capacity_factor > 0:
      raise ValueError(f"MoEConfig.capacity_factor must be > 0 or None; got {self.capacity_factor}.")
    if self.router == "expert_choice" and self.capacity_factor is None:
      raise ValueError("router='expert_choice' needs a capacity_factor (tokens per expert = cf * T / E).")
    if not isinstance(self.token_rounding, bool):
      raise ValueError(f"MoEConfig.token_rounding must be True or False; got {self.token_rounding!r}.")
    if self.token_rounding and (self.router != "top_k" or self.capacity_factor is not None):
      raise ValueError("MoEConfig.token_rounding rounds the dropless top-k layer: it needs router='top_k' and "
                       f"capacity_factor=None; got router={self.router!r}, capacity_factor={self.capacity_factor}.")
    if self.impl not in IMPLS:
      raise ValueError(f"MoEConfig.impl must be one of {IMPLS}; got {self.impl!r}.")
    if not self.jitter_eps >= 0:
      raise ValueError(f"MoEConfig.jitter_eps must be >= 0; got {self.jitter_eps}.")
    if not 0.0 <= self.dts_threshold < 1.0:
      raise ValueError(f"MoEConfig.dts_threshold must lie in [0, 1); got {self.dts_threshold}.")
    if self.dts_max_k is not None and not 1 <= self.dts_max_k <= self.num_experts:
      raise ValueError(
          f"MoEConfig.dts_max_k must lie in [1, num_experts={self.num_experts}] or be None; got {self.dts_max_k}.")

  @property
  def activation_fn(self):
    return ACTIVATIONS[self.activation]
