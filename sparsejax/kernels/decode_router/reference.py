"""decode_router's reference: the library's own router, softmax and top-k (what the model runs elsewhere)."""
from __future__ import annotations

from jaxtyping import Array, Float, Int

from sparsejax import routing


def decode_router_reference(
    x: Float[Array, "tokens d_model"],
    w_router: Float[Array, "d_model experts"],
    k: int,
    renormalize: bool | None = None,
) -> tuple[Int[Array, "tokens k"], Float[Array, "tokens k"]]:
  """(expert ids, combine weights) of top_k_routing(router_logits(x, w_router), k, renormalize)."""
  r = routing.top_k_routing(routing.router_logits(x, w_router), k, renormalize=renormalize)
  return r.expert_ids, r.combine_weights
