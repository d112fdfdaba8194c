"""The cluster's additions to ``requests.csv`` and ``summary.json``.

They appear only in cluster runs (more than one replica, pipeline stages, or
disaggregation), so a plain single-replica run writes exactly the core columns and keys.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sim.outputs import CsvSink, finished_request_line, request_row

if TYPE_CHECKING:
    from sim.cluster.colocated import Colocated
    from sim.cluster.config import ClusterConfig, DisaggregatedConfig
    from sim.cluster.disaggregated import Disaggregated
    from sim.cluster.pool import Pool
    from sim.request import Request

# Appended after the core REQUEST_COLUMNS. Co-located: both ids are the serving replica.
# kv_backpressure_wait: seconds from the first token until the decode replica could allocate
# the blocks (the request waited on the prefill side); kv_transfer_time: seconds from that
# allocation until the KV was in place (link queueing + serialization + latency).
CLUSTER_REQUEST_COLUMNS = ("prefill_replica_id", "decode_replica_id", "kv_transfer_bytes",
                           "kv_backpressure_wait", "kv_transfer_time")


class ClusterRequestSink:
    """Wraps the requests sink; appends ``extra(row)`` to every row a replica writes.
    ``extra`` reads the row's first two fields only (request and replica id): a finished
    request's row is not built as a tuple, ``extra`` gets those two."""

    def __init__(self, inner: CsvSink) -> None:
        self.inner = inner
        self.extra: Callable[[tuple], tuple] = lambda row: ("",) * len(CLUSTER_REQUEST_COLUMNS)

    def write(self, row: tuple) -> None:
        self.inner.write(row + self.extra(row))

    def write_request(self, req: Request) -> None:
        """As ``write(request_row(req))``; to a file, a finished request's line is formatted
        in one pass (``finished_request_line``) and the extra columns after it, when they
        are integers and strings that need no quoting (what ``csv.writer`` writes as is)."""
        line = finished_request_line(req) if self.inner.to_file else None
        if line is None:
            self.write(request_row(req))
            return
        extra = self.extra((req.request_id, req.replica_id))  # once: it may pop a record
        text = _plain_fields(extra)
        if text is None:
            self.inner.write(request_row(req) + extra)
        else:
            self.inner.write_text(f"{line[:-2]},{text}\r\n")

    def close(self) -> None:
        self.inner.close()


def _plain_fields(fields: tuple) -> str | None:
    """``fields`` joined as ``csv.writer`` writes them, when each is an int or a string it
    writes as is (no delimiter, quote or line break); else None."""
    out = []
    for v in fields:
        if type(v) is int:
            out.append(str(v))
        elif type(v) is str and not _SPECIAL.intersection(v):
            out.append(v)
        else:
            return None
    return ",".join(out)


_SPECIAL = frozenset(',"\r\n')


def cluster_summary(cfg: ClusterConfig | DisaggregatedConfig, pools: list[Pool],
                    deployment: Colocated | Disaggregated, sim_end: float) -> dict[str, Any]:
    per_replica = []
    i = 0
    for pool in pools:
        for _ in range(pool.count):
            r = deployment.replicas[i]
            per_replica.append({
                "replica_id": r.replica_id,
                "role": pool.role,
                "hardware": pool.hardware.name,
                "tensor_parallel_size": pool.tensor_parallel,
                "pipeline_parallel_size": pool.pipeline_parallel,
                "kv_num_gpu_blocks": r.kv.num_gpu_blocks,
                "routed": deployment.routed[i],
                "num_steps": r.num_steps,
                "busy_fraction": r.busy_time / sim_end if sim_end else 0.0,
                "kv_peak_usage": r.kv.peak_used_blocks / r.kv.num_gpu_blocks,
            })
            i += 1
    out: dict[str, Any] = {
        "cluster": deployment.kind,
        "num_replicas": len(deployment.replicas),
        "num_gpus": sum(p.num_gpus for p in pools),
        "router": cfg.router,
        "pipeline_parallel_size": cfg.pipeline_parallel_size,
    }
    if deployment.kind == "disaggregated":
        out.update({
            "num_prefill_replicas": pools[0].count,
            "num_decode_replicas": pools[1].count,
            "decode_router": cfg.decode_router,
            "link": cfg.link.preset,
            "link_bandwidth_gbps": cfg.link.bandwidth_bytes_per_s / 1e9,
            "link_latency_us": cfg.link.latency_s * 1e6,
            "link_scope": cfg.link.scope,
        })
    out.update(deployment.summary(sim_end))
    out["replicas"] = per_replica
    return out
