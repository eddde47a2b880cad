"""Replay workloads: synthetic routing, traces and sending arrangements."""

from .synthetic import synthetic_routing_maps

__all__ = ["synthetic_routing_maps"]
