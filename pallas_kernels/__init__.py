"""Pallas GPU kernels, each file beside the pure-jnp reference it is tested against."""
