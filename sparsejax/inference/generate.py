"""Text generation: one prefill over the (left-padded) prompts, then the decode loop on the device.

The KV cache lives in the model's nnx.Cache variables (Transformer.init_cache), as in Flax's own
decoding examples. The model is split once into (graphdef, params, cache); prefill, the single step
and the multi-step loop are plain jax.jit functions of their arrays, the cache donated so that XLA
updates it in place. All shapes are fixed (cache of P + N - 1 slots), so one compile of the loop
serves every token and every number of tokens: the host makes one call for all N - 1 steps instead
of one Python round trip per token, which costs more than a small model's whole step on a GPU.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Int

from sparsejax.inference.sampling import Sampling, sample_logits

# Steps per inner loop of Decoder.run (see _compiled_loop): a GPU syncs with the host once per chunk.
DECODE_CHUNK = 8


@dataclasses.dataclass(frozen=True)
class Generation:
  """tokens[b, i] is the i-th new token of prompt b. Times in seconds; the first step (and the
  prefill) include compilation on a first call, so decode_tokens_per_s counts steps 2..N only."""
  tokens: np.ndarray
  prompt_lengths: tuple[int, ...]
  prefill_s: float
  first_step_s: float
  decode_s: float

  @property
  def decode_tokens_per_s(self) -> float:
    steps = self.tokens.shape[1] - 2
    return self.tokens.shape[0] * steps / self.decode_s if steps > 0 and self.decode_s > 0 else float("nan")


def left_pad(prompts: Sequence[Sequence[int]] | np.ndarray | jax.Array
             ) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [B, P] with row b's prompt in its last len_b columns and 0 before, lengths [B])."""
  if isinstance(prompts, (np.ndarray, jax.Array)):
    arr = np.asarray(prompts)
    if arr.ndim == 1:
      arr = arr[None]
    if arr.ndim != 2:
      raise ValueError(f"prompt_tokens must be [batch, length] or a list of token lists; got shape {arr.shape}.")
    rows = list(arr)
  else:
    rows = [np.asarray(r) for r in prompts]
    if rows and all(r.ndim == 0 for r in rows):  # one prompt given as a flat list of ints
      rows = [np.asarray(prompts)]
  if not rows:
    raise ValueError("prompt_tokens is empty: give at least one prompt.")
  for i, r in enumerate(rows):
    if r.ndim != 1 or r.size == 0:
      raise ValueError(f"prompt {i} must be a non-empty 1-D list of token ids; got shape {r.shape}.")
    if not np.issubdtype(r.dtype, np.integer):
      raise TypeError(f"prompt {i} must hold integer token ids; got dtype {r.dtype}.")
  lengths = np.array([r.size for r in rows], np.int32)
  tokens = np.zeros((len(rows), int(lengths.max())), np.int32)
  for i, r in enumerate(rows):
    tokens[i, tokens.shape[1] - r.size:] = r
  return tokens, lengths


def _step_fn(graphdef, params_def, cache_def, sampling: Sampling):
  """step(params, cache, tokens [B, T], rng, step) -> (next tokens [B], new cache, routing counts):
  append tokens to the cache, next[b] ~ sample(logits[b, -1]) with the key fold_in(rng, step)."""

  def step(params, cache, tokens, rng, step):
    model = nnx.merge(graphdef, params_def.unflatten(params), cache_def.unflatten(cache))
    logits, stats = model(tokens, decode=True)
    nxt = sample_logits(logits[:, -1], jax.random.fold_in(rng, step), sampling)
    return nxt, jax.tree.leaves(nnx.state(model, nnx.Cache)), stats.tokens_per_expert

  return step


@functools.lru_cache(maxsize=64)
def _compiled_step(graphdef, params_def, cache_def, sampling: Sampling):
  """One jitted function per model structure and sampling rule, shared by every Decoder of it.

  It takes the params and the cache as flat lists of arrays and closes over the graphdef: a jit
  with the graphdef as a static argument would hash it, and flatten nnx.State pytrees, on every
  call, costing more host time than a small model's whole decode step on a GPU.
  """
  return jax.jit(_step_fn(graphdef, params_def, cache_def, sampling), donate_argnums=(1,))


@functools.lru_cache(maxsize=64)
def _compiled_loop(graphdef, params_def, cache_def, sampling: Sampling, chunk: int, width: int):
  """run(params, cache, tokens [B], rng, step, n) -> (out [B, width], last [B], cache, routing counts):
  n decode steps in one jitted call. Step j feeds the previous token (tokens for j = 0) and samples
  out[:, j] with the key fold_in(rng, step + j), exactly as n calls of the one-step function would;
  last = out[:, n - 1] and the routing counts are those of step n - 1. Columns >= n of out are junk.

  n is traced, so one compile serves every n (every max_new_tokens). A while_loop with a traced trip
  count costs, on a GPU, one device-to-host copy of the loop predicate and a host sync per iteration
  (XLA's WhileThunk); a loop of static length runs without them, the host queueing iterations ahead.
  So the steps run in chunks: an outer while_loop over ceil(n / chunk) chunks (one sync each) around
  an inner loop of exactly `chunk` steps. The last chunk's steps past n still run (at most chunk - 1
  wasted steps per call) and their results are dropped; their keys and values land in cache slots
  past the new write index, which attention never reads before a later step writes them again (a
  write past the last slot clamps onto it, and then the cache is full, so no later step reads it).
  The write index is set to index + n at the end. Same flat-params closure as _compiled_step.
  """
  step_fn = _step_fn(graphdef, params_def, cache_def, sampling)

  def merged(params, cache):
    return nnx.merge(graphdef, params_def.unflatten(params), cache_def.unflatten(cache))

  def run(params, cache, tokens, rng, step, n):
    index = merged(params, cache).cache_index[...]
    counts = jax.eval_shape(step_fn, params, cache, tokens[:, None], rng, step)[2]

    def one(j, carry):
      cache, tok, out, last, tpe = carry
      nxt, cache, step_tpe = step_fn(params, cache, tok[:, None], rng, step + j)
      live = j < n
      out = jax.lax.dynamic_update_slice(out, nxt[:, None], (jnp.int32(0), j))
      return cache, nxt, out, jnp.where(live, nxt, last), jnp.where(live, step_tpe, tpe)

    def one_chunk(c, carry):
      return jax.lax.fori_loop(0, chunk, lambda u, carry: one(c * chunk + u, carry), carry)

    init = (cache, tokens, jnp.zeros((tokens.shape[0], width), jnp.int32), tokens,
            jnp.zeros(counts.shape, counts.dtype))
    cache, _, out, last, tpe = jax.lax.fori_loop(0, (n + chunk - 1) // chunk, one_chunk, init)
    model = merged(params, cache)
    model.cache_index[...] = index + n
    return out, last, jax.tree.leaves(nnx.state(model, nnx.Cache)), tpe

  return jax.jit(run, donate_argnums=(1,))


class Decoder:
  """A model with a KV cache of `cache_length` slots for `batch_size` rows, and its jitted steps.

  decoder(prompts [B, P]) fills the cache with the left-padded prompts (row b's padding is start[b])
  and samples each row's next token; decoder(tokens [B, 1]) then appends one token per row and samples
  the next; both return int32 [B]. decoder.run(tokens [B], n) does n such steps in one call on the
  device and returns their [B, n] tokens. Step s (the prefill is step 0) samples with the key
  fold_in(rng, s) either way, so run gives exactly the tokens of n single steps. tokens_per_expert
  holds the last step's [moe_layers, experts] routing counts. Each shape of call compiles once; run
  compiles once whatever n.
  """

  def __init__(self, model: nnx.Module, batch_size: int, cache_length: int, sampling: Sampling,
               rng: jax.Array | None = None, start: np.ndarray | None = None, chunk: int = DECODE_CHUNK):
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
      raise ValueError(f"chunk must be an int >= 1; got {chunk!r}.")
    graphdef, params = nnx.split(model)
    decoding = nnx.merge(graphdef, params)  # a second view on the same arrays: the caller's model stays cache-free
    decoding.init_cache(batch_size, cache_length, start=start)
    graphdef, cache, params = nnx.split(decoding, nnx.Cache, ...)
    self.params, params_def = jax.tree.flatten(params)
    self.cache, cache_def = jax.tree.flatten(cache)
    self._step = _compiled_step(graphdef, params_def, cache_def, sampling)
    width = -(-cache_length // chunk) * chunk  # room for every step of ceil(n / chunk) chunks, n <= cache_length
    self._loop = _compiled_loop(graphdef, params_def, cache_def, sampling, int(chunk), width)
    self.rng = jax.random.key(0) if rng is None else rng
    self.batch_size, self.cache_length = batch_size, cache_length
    self.steps = 0  # calls so far, counting each step of run: the next step's rng fold
    self.position = 0  # cache slots filled so far
    self.tokens_per_expert = None

  def _claim(self, t: int) -> None:
    if self.position + t > self.cache_length:
      raise ValueError(f"the cache holds {self.cache_length} slots and {self.position} "
                       f"{'is' if self.position == 1 else 'are'} filled: no room for {t} more "
                       f"token{'s' * (t != 1)}.")

  def __call__(self, tokens: Int[Array, "b t"]) -> Int[Array, "b"]:
    self._claim(tokens.shape[1])
    nxt, self.cache, self.tokens_per_expert = self._step(self.params, self.cache, tokens, self.rng,
                                                         np.int32(self.steps))
    self.steps += 1
    self.position += tokens.shape[1]
    return nxt

  def run_buffer(self, tokens: Int[Array, "b"], n: int) -> tuple[Int[Array, "b w"], Int[Array, "b"]]:
    """run() without the slice: (out [B, w >= n] whose first n columns are the tokens, the last token).

    For callers that time the loop or chain calls: the slice out[:, :n] is one more small compile
    per n, which can wait until the tokens reach the host.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
      raise ValueError(f"n must be an int >= 1; got {n!r}.")
    if tuple(tokens.shape) != (self.batch_size,):
      raise ValueError(f"run takes the last sampled token of each row, shape ({self.batch_size},); "
                       f"got shape {tuple(tokens.shape)}.")
    self._claim(n)
    out, last, self.cache, self.tokens_per_expert = self._loop(self.params, self.cache, tokens, self.rng,
                                                               np.int32(self.steps), np.int32(n))
    self.steps += n
    self.position += n
    return out, last

  def run(self, tokens: Int[Array, "b"], n: int) -> Int[Array, "b n"]:
    """n decode steps in one device loop: feed tokens, sample, feed the sample, ...; the [B, n] samples."""
    return self.run_buffer(tokens, n)[0][:, :n]


def _check_args(model, max_new_tokens, sampling, rng):
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an int >= 1; got {max_new_tokens!r}.")
  if not sampling.greedy and rng is None:
    raise ValueError("sampling with temperature > 0 needs rng=jax.random.key(seed) (or temperature=0: greedy).")
  if rng is not None and not (isinstance(rng, jax.Array) and (jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
                                                               or rng.shape == (2,))):
    raise TypeError(f"rng must be a jax key (jax.random.key(seed)); got {rng!r}.")
  if not hasattr(model, "init_cache"):
    raise TypeError(f"generate needs a model with init_cache and decode=True (a sparsejax Transformer); "
                    f"got {type(model).__name__}.")


def generate_timed(model: nnx.Module, prompt_tokens, max_new_tokens: int, *, temperature: float = 1.0,
                   top_k: int | None = None, top_p: float | None = None, rng: jax.Array | None = None,
                   cache_length: int | None = None) -> Generation:
  """generate(), with the tokens as a numpy array and the time of the prefill and of the steps."""
  sampling = Sampling(temperature, top_k, top_p)
  _check_args(model, max_new_tokens, sampling, rng)
  tokens, lengths = left_pad(prompt_tokens)
  vocab = model.cfg.vocab_size
  if tokens.min() < 0 or tokens.max() >= vocab:
    raise ValueError(f"prompt token ids must lie in [0, vocab_size={vocab}); got [{tokens.min()}, {tokens.max()}].")
  batch, prompt_len = tokens.shape
  need = prompt_len + max_new_tokens - 1  # the last new token is sampled, never fed back
  if cache_length is None:
    cache_length = need
    if need > model.cfg.max_seq_len:
      raise ValueError(f"the longest prompt ({prompt_len} token{'s' * (prompt_len != 1)}) plus "
                       f"max_new_tokens={max_new_tokens} needs {need} positions, more than the model's "
                       f"max_seq_len={model.cfg.max_seq_len}.")
  elif need > cache_length:
    raise ValueError(f"the longest prompt ({prompt_len} token{'s' * (prompt_len != 1)}) plus "
                     f"max_new_tokens={max_new_tokens} needs {need} cache slots; cache_length is {cache_length}.")
  decoder = Decoder(model, batch, cache_length, sampling, rng, start=prompt_len - lengths)
  t0 = time.perf_counter()
  first = decoder(jnp.asarray(tokens))
  out = [np.asarray(first)[:, None]]
  t1 = time.perf_counter()
  if max_new_tokens > 1:  # one loop call of 1 step (it compiles the loop), then one of the rest: same executable
    buf, last = decoder.run_buffer(first, 1)
    out.append(np.asarray(buf)[:, :1])
  t2 = time.perf_counter()
  if max_new_tokens > 2:
    buf, _ = decoder.run_buffer(last, max_new_tokens - 2)
    out.append(np.asarray(buf)[:, :max_new_tokens - 2])
  t3 = time.perf_counter()
  return Generation(np.concatenate(out, axis=1), tuple(int(n) for n in lengths), t1 - t0, t2 - t1, t3 - t2)


def generate(model: nnx.Module, prompt_tokens, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, rng: jax.Array | None = None,
             cache_length: int | None = None) -> Int[Array, "b max_new_tokens"]:
  """Sample max_new_tokens tokens after each prompt: tokens[b, i] ~ p(. | prompt_b, tokens[b, :i]).

  prompt_tokens: a list of token-id lists (lengths may differ), a [B, P] array, or one 1-D prompt.
  Prompts are left-padded into one batch (see inference.kv_cache for why left); temperature=0 is greedy,
  else rng (a jax key) drives the sampling, restricted by top_k / top_p. The cache holds
  cache_length slots (default: longest prompt + max_new_tokens - 1, at most the model's max_seq_len).
  MoE layers run dropless while decoding, whatever capacity_factor the model was trained with.
  """
  g = generate_timed(model, prompt_tokens, max_new_tokens, temperature=temperature, top_k=top_k,
                     top_p=top_p, rng=rng, cache_length=cache_length)
  return jnp.asarray(g.tokens)
