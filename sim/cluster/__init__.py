"""Deployments of several replicas: a router in front of co-located replicas, or a prefill
pool and a decode pool joined by a KV-transfer link (see docs/cluster.md)."""

from sim.cluster.router import ROUTERS, Router, make_router

__all__ = ["ROUTERS", "Router", "make_router"]
