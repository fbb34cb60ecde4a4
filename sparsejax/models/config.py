"""The one config dataclass of the Transformer LM, and its named presets.

Sizes follow the MegaBlocks paper (Gale et al. 2022, Table 1): XS 512 x 8, Small 768 x 12,
Medium 1024 x 24, d_ff = 4 d_model, MoE variants with 64 top-1 experts in every layer. The
vocabulary is 256 (bytes), so nothing needs downloading; `tiny-*` presets train on a CPU.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any

import jax.numpy as jnp

from sparsejax.config import MoEConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
REMAT = ("none", "block", "ffn", "hidden")
# Fields that say how the model runs, not what it computes: a run may resume with other values of these.
RUN_FIELDS = ("remat", "moe_impl", "attention_impl")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """A decoder-only LM. Block i has an MoE feed-forward iff moe_every > 0 and i % moe_every == moe_every - 1.

  moe_every=0 is the dense model; 1 puts an MoE in every block (MegaBlocks); 2 in every other (Switch).
  capacity_factor=None is dropless. dtype is the compute dtype, param_dtype the storage dtype.
  All fields are plain Python values so the config round-trips through JSON (checkpoints store it).
  """
  d_model: int
  num_layers: int
  num_heads: int
  d_ff: int
  vocab_size: int = 256
  max_seq_len: int = 2048
  rope_base: float = 10_000.0
  moe_every: int = 0
  num_experts: int = 64
  top_k: int = 1
  capacity_factor: float | None = None
  renormalize: bool | None = None
  glu: bool = False
  activation: str = "gelu"
  load_balancing_weight: float = 1e-2
  z_loss_weight: float = 1e-3
  jitter_eps: float = 0.0
  token_rounding: bool = False  # MoEConfig.token_rounding
  moe_impl: str = "auto"
  dtype: str = "float32"
  param_dtype: str = "float32"
  attention_impl: str = "auto"  # "auto" (cuDNN on GPU for bf16/fp16, else XLA), "xla", "cudnn"
  # Training's activation memory: "block" keeps only each block's input for the backward and recomputes
  # the rest there; "ffn" recomputes only the feed-forward (its norm, router, placement and products);
  # "hidden" only its hidden layer (the d_ff-wide first products and activation), keeping the experts' rows.
  remat: str = "none"

  def __post_init__(self):
    for name in ("d_model", "num_layers", "num_heads", "d_ff", "vocab_size", "max_seq_len", "num_experts", "top_k"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"TransformerConfig.{name} must be a positive int; got {v!r}.")
    # Checked here, not left to MoEConfig: below, only an MoE config builds one, so a dense config would pass
    # until its model is built, and a string such as "False" would reach the layers as a truthy flag.
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.type in ("bool", "bool | None") and not (isinstance(v, bool) or (v is None and f.type != "bool")):
        raise ValueError(f"TransformerConfig.{f.name} must be True or False{' or None' * (f.type != 'bool')}; "
                         f"got {v!r}.")
    # rope_base <= 0 gives NaN (or inf) rotary frequencies, which train to NaN without an error.
    if not (isinstance(self.rope_base, (int, float)) and not isinstance(self.rope_base, bool)
            and math.isfinite(self.rope_base) and self.rope_base > 0):
      raise ValueError(f"TransformerConfig.rope_base must be a finite number > 0; got {self.rope_base!r}.")
    if self.d_model % self.num_heads:
      raise ValueError(f"TransformerConfig.d_model={self.d_model} is not divisible by "
                       f"num_heads={self.num_heads}; pick heads that divide the hidden size.")
    if (self.d_model // self.num_heads) % 2:
      raise ValueError(f"head_dim={self.d_model // self.num_heads} must be even for rotary embeddings.")
    if not isinstance(self.moe_every, int) or isinstance(self.moe_every, bool) or self.moe_every < 0:
      raise ValueError(f"TransformerConfig.moe_every must be an int >= 0 (0 = dense); got {self.moe_every!r}.")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"TransformerConfig.{name} must be one of {tuple(DTYPES)}; got {getattr(self, name)!r}.")
    if self.attention_impl not in ("auto", "xla", "cudnn"):
      raise ValueError(f"attention_impl must be 'auto', 'xla' or 'cudnn'; got {self.attention_impl!r}.")
    if self.remat not in REMAT:
      raise ValueError(f"TransformerConfig.remat must be one of {', '.join(map(repr, REMAT))}; got {self.remat!r}.")
    if self.moe_every:
      self.moe_config()  # MoEConfig validates experts, top_k, capacity factor, activation.

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def compute_dtype(self) -> Any:
    return DTYPES[self.dtype]

  def is_moe_layer(self, i: int) -> bool:
    return self.moe_every > 0 and i % self.moe_every == self.moe_every - 1

  @property
  def num_moe_layers(self) -> int:
    return sum(self.is_moe_layer(i) for i in range(self.num_layers))

  def moe_config(self) -> MoEConfig:
    """The feed-forward config: MoE layers use all fields, dense layers the MoEConfig's d_ff/glu/activation."""
    return MoEConfig(
        d_model=self.d_model, d_ff=self.d_ff, num_experts=self.num_experts, top_k=self.top_k,
        capacity_factor=self.capacity_factor, glu=self.glu, activation=self.activation,
        renormalize=self.renormalize, load_balancing_weight=self.load_balancing_weight,
        z_loss_weight=self.z_loss_weight, jitter_eps=self.jitter_eps, token_rounding=self.token_rounding,
        dtype=self.compute_dtype, param_dtype=DTYPES[self.param_dtype], impl=self.moe_impl)

  def replace(self, **changes) -> "TransformerConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "TransformerConfig":
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})

  @classmethod
  def identity(cls, d: dict) -> dict:
    """A saved config dict as the model it describes: fields added since it was saved take their defaults, and
    RUN_FIELDS are left out, so equal identities mean the same parameters and the same math."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    return {k: v for k, v in {**defaults, **d}.items() if k not in RUN_FIELDS}

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token: 6 N_active + 12 L d T (PaLM, appendix B), N_active without the embedding.

    N_active counts top_k experts per MoE layer (what a token actually multiplies by) and the router.
    """
    d, f = self.d_model, self.d_ff
    ffn = (3 if self.glu else 2) * d * f
    n = self.num_layers * 4 * d * d + d * self.vocab_size
    for i in range(self.num_layers):
      n += ffn * self.top_k + d * self.num_experts if self.is_moe_layer(i) else ffn
    return 6.0 * n + 12.0 * self.num_layers * d * seq_len


def _sizes(d, layers, heads, experts=64, **kw):
  dense = TransformerConfig(d_model=d, num_layers=layers, num_heads=heads, d_ff=4 * d, **kw)
  return dense, dense.replace(moe_every=1, num_experts=experts)


PRESETS: dict[str, TransformerConfig] = {}
for _name, _args in {
    "tiny": dict(d=128, layers=4, heads=4, experts=8, max_seq_len=256),
    "xs": dict(d=512, layers=8, heads=8),
    "small": dict(d=768, layers=12, heads=12),
    "medium": dict(d=1024, layers=24, heads=16),
}.items():
  PRESETS[f"{_name}-dense"], PRESETS[f"{_name}-moe"] = _sizes(**_args)
# The tiny MoE is Switch-style (MoE every other block), so it also shows dense and MoE blocks mixed.
PRESETS["tiny-moe"] = PRESETS["tiny-moe"].replace(moe_every=2)
PRESETS["tiny"] = PRESETS["tiny-moe"]


def get_preset(name: str, **overrides) -> TransformerConfig:
  """PRESETS[name] with fields replaced; unknown names fail with the list of known ones."""
  if name not in PRESETS:
    close = difflib.get_close_matches(name, PRESETS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"Unknown preset {name!r}.{hint} Known presets: {', '.join(sorted(PRESETS))}.")
  return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
