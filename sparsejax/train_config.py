"""TrainConfig: everything a training run needs, checked when it is made.

Pure Python (no jax import), so that the `sparsejax-train` command can parse and check its
arguments, and answer `--help`, before it pays for importing jax.
"""
from __future__ import annotations

import dataclasses
import math

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
MU_DTYPES = ("float32", "bfloat16")


MESH_AXES = ("data", "expert_group", "expert")  # mesh order: the inner axes stay within a host


def _parse_mesh(text) -> dict[str, int] | None:
  """"data=2,expert_group=2,expert=2" -> {"data": 2, "expert_group": 2, "expert": 2}: data and expert
  default to 1, expert_group is present only when given; None when the text is malformed."""
  if not isinstance(text, str):
    return None
  sizes = {}
  for item in text.replace(" ", "").split(","):
    name, sep, value = item.partition("=")
    if not sep or name not in MESH_AXES or name in sizes or not value.isdigit() or int(value) < 1:
      return None
    sizes[name] = int(value)
  return {a: sizes.get(a, 1) for a in MESH_AXES if a != "expert_group" or a in sizes}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything a run needs; model_overrides replace fields of the preset's TransformerConfig."""
  preset: str = "tiny"
  data: str | None = None          # None: the Python standard library's sources
  out: str = "runs/tiny"
  steps: int = 200
  batch_size: int = 16
  seq_len: int = 64
  lr: float = 3e-3
  min_lr_ratio: float = 0.1
  warmup: int = 20
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  adam_mu_dtype: str = "float32"   # AdamW's first moment; "bfloat16" halves its bytes
  grad_accum: int = 1              # microbatches per step: batch_size rows, one AdamW update
  seed: int = 0
  dtype: str | None = None         # compute dtype; None: bfloat16 on GPU/TPU, float32 on CPU
  eval_every: int = 100
  eval_every_s: float | None = None  # also evaluate every this many seconds of training time
  eval_batches: int = 8
  ckpt_every: int = 100            # 0: no checkpoints at all (e.g. timing experiments)
  keep: int = 3
  log_every: int = 10
  max_time_s: float | None = None  # stop after this much training time (compile and eval excluded)
  upcycle_from: str | None = None  # a dense run's out dir (or checkpoint dir): preset must be its MoE twin
  peak_flops: float | None = None  # per device; None: looked up from the device kind
  allow_binary: bool = False       # accept a data file that does not look like text
  mesh: str | None = None          # "data=D[,expert_group=G],expert=X": expert parallelism over D*[G*]X devices
  ep_buffer_factor: float | None = None  # with mesh: ExpertParallelConfig.buffer_factor (None: the safe bound)
  progress: bool = True
  model_overrides: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    """Each bad value fails here with one line naming the option, before anything is built."""
    def need(ok: bool, name: str, rule: str):
      if not ok:
        raise ValueError(f"--{name.replace('_', '-')} must be {rule}; got {getattr(self, name)!r}.")

    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
    is_num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    for name in ("steps", "batch_size", "seq_len", "eval_batches", "keep", "log_every", "grad_accum"):
      need(is_int(getattr(self, name)) and getattr(self, name) >= 1, name, "an integer >= 1")
    if self.batch_size % self.grad_accum:
      raise ValueError(f"--batch-size {self.batch_size} does not split into --grad-accum {self.grad_accum} "
                       f"microbatches: pass a multiple of {self.grad_accum}.")
    for name in ("warmup", "eval_every", "ckpt_every", "seed"):
      need(is_int(getattr(self, name)) and getattr(self, name) >= 0, name, "an integer >= 0")
    for name in ("lr", "grad_clip"):
      need(is_num(getattr(self, name)) and getattr(self, name) > 0, name, "a finite number > 0")
    need(is_num(self.weight_decay) and self.weight_decay >= 0, "weight_decay", "a finite number >= 0")
    need(is_num(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "a number in [0, 1]")
    for name in ("eval_every_s", "max_time_s", "peak_flops", "ep_buffer_factor"):
      v = getattr(self, name)
      need(v is None or (is_num(v) and v > 0), name, "a finite number > 0 (or unset)")
    need(self.dtype is None or self.dtype in COMPUTE_DTYPES, "dtype", f"one of {', '.join(COMPUTE_DTYPES)}")
    need(self.adam_mu_dtype in MU_DTYPES, "adam_mu_dtype", f"one of {', '.join(MU_DTYPES)}")
    need(isinstance(self.preset, str) and bool(self.preset), "preset", "a preset name")
    need(isinstance(self.out, str) and bool(self.out.strip()), "out", "a folder path")
    need(self.mesh is None or _parse_mesh(self.mesh) is not None, "mesh",
         "'data=D,expert=X' or 'data=D,expert_group=G,expert=X' with integers >= 1 "
         "(data or expert left out: 1)")
    if self.ep_buffer_factor is not None and self.mesh is None:
      raise ValueError("--ep-buffer-factor sizes the expert-parallel exchange: it needs --mesh.")

  def mesh_shape(self) -> dict[str, int] | None:
    """{axis: devices} of --mesh in mesh order ("expert_group" only when given), None without one."""
    return None if self.mesh is None else _parse_mesh(self.mesh)

  def model_config(self):
    """The preset's TransformerConfig with dtype, model_overrides and max_seq_len >= seq_len applied."""
    import jax  # here, not at the top: see the module docstring

    from sparsejax.models import get_preset
    dtype = self.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    cfg = get_preset(self.preset, **{"dtype": dtype, **self.model_overrides})
    if self.seq_len > cfg.max_seq_len:
      cfg = cfg.replace(max_seq_len=self.seq_len)
    return cfg
