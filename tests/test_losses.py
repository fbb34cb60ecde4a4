"""Aux losses against their formulas on cases small enough to compute by hand."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax as sj


@pytest.mark.parametrize("T,E,k", [(8, 4, 1), (12, 6, 2), (16, 8, 8)])
def test_load_balancing_is_one_under_uniform_routing(T, E, k):
  probs = jnp.full((T, E), 1.0 / E)
  ids = jnp.asarray((np.arange(T * k) % E).reshape(T, k), jnp.int32)  # every expert equally often
  assert float(sj.load_balancing_loss(probs, ids)) == pytest.approx(1.0, rel=1e-6)


def test_load_balancing_hand_computed_2x2():
  probs = jnp.asarray([[0.9, 0.1], [0.4, 0.6]])  # P = [0.65, 0.35]
  # Both tokens to expert 0: f = [1, 0]; loss = 2 * (1 * 0.65) = 1.3.
  assert float(sj.load_balancing_loss(probs, jnp.asarray([[0], [0]]))) == pytest.approx(1.3, rel=1e-6)
  # 1-D ids mean k = 1.
  assert float(sj.load_balancing_loss(probs, jnp.asarray([0, 0]))) == pytest.approx(1.3, rel=1e-6)
  # One each: f = [0.5, 0.5]; loss = 2 * (0.5 * 0.65 + 0.5 * 0.35) = 1.
  assert float(sj.load_balancing_loss(probs, jnp.asarray([[0], [1]]))) == pytest.approx(1.0, rel=1e-6)
  # Both tokens to expert 1: 2 * 0.35 = 0.7.
  assert float(sj.load_balancing_loss(probs, jnp.asarray([[1], [1]]))) == pytest.approx(0.7, rel=1e-6)
  # k = 2 with a NO_EXPERT slot: assignments [0, 0, 1] -> f = [2/3, 1/3]; 2 * (2/3 * .65 + 1/3 * .35).
  ids = jnp.asarray([[0, 1], [0, sj.NO_EXPERT]])
  expect = 2 * (2 / 3 * 0.65 + 1 / 3 * 0.35)
  assert float(sj.load_balancing_loss(probs, ids)) == pytest.approx(expect, rel=1e-6)


def test_load_balancing_gradient_flows_through_probs_only():
  probs = jnp.asarray([[0.9, 0.1], [0.4, 0.6], [0.5, 0.5]])
  ids = jnp.asarray([[0], [0], [1]])
  g = jax.jit(jax.grad(sj.load_balancing_loss))(probs, ids)
  # d/dp[t, i] of E * sum_i f_i * mean_t p[t, i] = E * f_i / T, with f = [2/3, 1/3].
  np.testing.assert_allclose(g, np.tile([2 * (2 / 3) / 3, 2 * (1 / 3) / 3], (3, 1)), rtol=1e-6)


def test_router_z_loss_known_logits():
  # Row 0: logsumexp([0, 0]) = ln 2. Row 1: logsumexp([0, ln 3]) = ln 4 = 2 ln 2.
  logits = jnp.asarray([[0.0, 0.0], [0.0, math.log(3.0)]])
  expect = (math.log(2) ** 2 + (2 * math.log(2)) ** 2) / 2
  assert float(sj.router_z_loss(logits)) == pytest.approx(expect, rel=1e-6)
  # Shifting every logit by c shifts logsumexp by c.
  assert float(sj.router_z_loss(logits + 1.0)) == pytest.approx(
      ((math.log(2) + 1) ** 2 + (2 * math.log(2) + 1) ** 2) / 2, rel=1e-6)
  # Gradient: d/dlogits mean_t z_t^2 = 2 z_t softmax(logits_t) / T.
  g = jax.jit(jax.grad(sj.router_z_loss))(logits)
  z = np.array([math.log(2), 2 * math.log(2)])
  sm = np.asarray(jax.nn.softmax(logits))
  np.testing.assert_allclose(g, 2 * z[:, None] * sm / 2, rtol=1e-6)


def test_router_z_loss_bf16_logits_in_float32():
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((32, 8)) * 4, jnp.bfloat16)
  out = sj.router_z_loss(logits)
  assert out.dtype == jnp.float32
  l64 = np.asarray(logits.astype(jnp.float32), np.float64)
  m = l64.max(-1, keepdims=True)
  z = (m + np.log(np.exp(l64 - m).sum(-1, keepdims=True)))[:, 0]
  assert float(out) == pytest.approx(float(np.mean(z**2)), rel=1e-6)
