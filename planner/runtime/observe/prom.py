"""The Prometheus endpoint of a run (`planner run --metrics-port P`): rank 0 serves the
series of planner.runtime.observe.watch.SERIES on http://HOST:P/metrics (prometheus_client's
own HTTP server, a daemon thread), updated once per optimizer step."""
from __future__ import annotations

import socket
from typing import Any

from planner.runtime.observe.watch import SERIES

LOCAL = "127.0.0.1"
PER_RANK = ("planner_peak_memory_bytes", "planner_allreduce_seconds", "planner_allreduce_calls",
            "planner_allreduce_latency_seconds", "planner_gpu_utilization_percent")
EAGER = ("planner_step",)
"""Series that exist from the start: 0 steps completed is true before step 1. Every other series
appears with its first value (an unset Gauge would read 0, a drop to zero on a dashboard)."""


def port_problem(port: int, host: str = LOCAL) -> str:
    """Why `port` cannot be served on `host`, or "" (bind test; the socket is closed again)."""
    if not 1 <= port <= 65535:
        return f"{port} is not a TCP port (1-65535)"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # as prometheus_client's server does (HTTPServer.allow_reuse_address): a port left in
        # TIME_WAIT by an earlier run is free, one something listens on is not
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return ""


class Exporter:
    """Gauges in their own registry (no process/GC collectors: the series are the run's)."""

    def __init__(self, port: int, host: str = LOCAL) -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server
        self.registry = CollectorRegistry()
        self._gauge = lambda name: Gauge(name, SERIES[name], ["rank"] if name in PER_RANK else [],
                                         registry=self.registry)
        self.gauges: dict[str, Any] = {name: self._gauge(name) for name in EAGER}
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)

    def _set(self, name: str, value: float, rank: str | None = None) -> None:
        if name not in self.gauges:
            self.gauges[name] = self._gauge(name)
        g = self.gauges[name]
        (g.labels(rank) if rank is not None else g).set(value)

    def step(self, rec: dict[str, Any], per_rank: list[dict[str, float | None]]) -> None:
        """rec: the step's progress record; per_rank: {peak_memory_bytes, allreduce_seconds,
        allreduce_calls, gpu_utilization_percent} of every rank, in rank order."""
        self._set("planner_step", rec["step"])
        for key, name in (("tokens_per_s", "planner_tokens_per_second"), ("time_s", "planner_step_time_seconds"),
                          ("loss", "planner_loss"), ("grad_norm", "planner_grad_norm"),
                          ("lr", "planner_learning_rate"), ("eval_loss", "planner_eval_loss")):
            if rec.get(key) is not None:
                self._set(name, rec[key])
        for r, m in enumerate(per_rank):
            lab = str(r)
            self._set("planner_peak_memory_bytes", m["peak_memory_bytes"], lab)
            self._set("planner_allreduce_seconds", m["allreduce_seconds"], lab)
            self._set("planner_allreduce_calls", m["allreduce_calls"], lab)
            self._set("planner_allreduce_latency_seconds",
                      m["allreduce_seconds"] / m["allreduce_calls"] if m["allreduce_calls"] else 0.0, lab)
            if m.get("gpu_utilization_percent") is not None:
                self._set("planner_gpu_utilization_percent", m["gpu_utilization_percent"], lab)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
