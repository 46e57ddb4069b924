"""Mixture-of-Experts support shared by the rollout engines and the training engines: the routers of a
transformers MoE model, a tap on them that records the experts each token was routed to or replays recorded
choices (rollout routing replay, :mod:`hf_verl.moe.routing`), and the routing metrics (:mod:`hf_verl.moe.metrics`).
"""

from hf_verl.moe.metrics import ROUTING_METRICS, routing_metrics
from hf_verl.moe.routing import NOT_ROUTED, RoutingTap, find_routers, is_moe_model

__all__ = ["NOT_ROUTED", "ROUTING_METRICS", "RoutingTap", "find_routers", "is_moe_model", "routing_metrics"]
