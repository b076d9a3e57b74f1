"""What a running trainer shows: the per-step progress line, time in all-reduce, and the
Prometheus alert rules and Grafana dashboard written into the run directory.

Pure Python apart from AllReduceTimer (which wraps torch.distributed.all_reduce), so the
formats are unit-tested without a training run (tests/unit/test_trainer_units.py).
"""
from __future__ import annotations

import json
import time
from typing import Any

ALERT_GPU_UTIL_PERCENT = 40
ALERT_GPU_UTIL_FOR = "5m"
ALERT_ALLREDUCE_LATENCY_S = 0.050
"""Alert thresholds of the source article (as quoted in issue 10): GPU utilisation below 40%
for 5 minutes; all-reduce latency above 50 ms."""

ALERTS_FILE = "prometheus-alerts.yml"
DASHBOARD_FILE = "grafana-dashboard.json"

# Prometheus series (planner/runtime/observe/prom.py serves them; the rules and dashboard use them)
SERIES = {
    "planner_step": "Optimizer steps completed",
    "planner_tokens_per_second": "Real (non-padding) tokens per second in the last step",
    "planner_step_time_seconds": "Wall time of the last optimizer step (slowest rank)",
    "planner_loss": "Training loss of the last step (averaged over DP and micro-batches)",
    "planner_grad_norm": "Global gradient norm of the last step",
    "planner_learning_rate": "Learning rate the last step used",
    "planner_eval_loss": "Held-out loss at the last evaluation",
    "planner_peak_memory_bytes": "Peak memory of each rank since the start of training",
    "planner_allreduce_seconds": "Time in torch.distributed.all_reduce during the last step, per rank",
    "planner_allreduce_calls": "all_reduce calls during the last step, per rank",
    "planner_allreduce_latency_seconds": "Mean time per all_reduce call during the last step, per rank",
    "planner_gpu_utilization_percent": "GPU utilisation per rank (torch.cuda.utilization; GPU runs only)",
}


class AllReduceTimer:
    """Time spent in torch.distributed.all_reduce by this rank (DeepSpeed's gradient
    all-reduces go through deepspeed.comm -> torch.distributed.all_reduce; the executor's
    tensor-parallel layers call it directly). Installed by wrapping the module attribute, so
    every caller that looks it up at call time is timed. Synchronous calls are timed to their
    return, which on gloo (CPU) is the end of the collective; on CUDA the device is
    synchronised before and after each timed call so the time is the collective's, not the
    launch's (this serialises communication the step would otherwise overlap: the timer is
    installed only for --metrics-port). async_op=True calls count their launch only."""

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self.seconds = 0.0
        self.calls = 0
        self._orig = None

    def install(self) -> "AllReduceTimer":
        import torch
        import torch.distributed as dist
        orig = dist.all_reduce
        self._orig = orig
        sync = torch.cuda.synchronize if self.cuda else (lambda: None)

        def timed(*args, **kw):
            sync()
            t0 = time.perf_counter()
            try:
                return orig(*args, **kw)
            finally:
                sync()
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        timed.__wrapped__ = orig  # type: ignore[attr-defined]
        dist.all_reduce = timed
        return self

    @property
    def original(self):
        """The unwrapped all_reduce (the trainer's own per-step collective is not counted)."""
        import torch.distributed as dist
        return self._orig or dist.all_reduce

    def take(self) -> tuple[float, int]:
        """(seconds, calls) since the last take."""
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def format_progress(rec: dict[str, Any]) -> str:
    """One line for a progress.jsonl record (rank 0 prints it; `planner run` echoes it)."""
    kind = rec.get("kind")
    if kind == "step":
        total = rec.get("total")
        parts = [f"step {rec['step']}/{total}" if total else f"step {rec['step']}",
                 f"loss {_num(rec.get('loss'), '.4f')}",
                 f"lr {_num(rec.get('lr'), '.3g')}",
                 f"tokens/s {_num(rec.get('tokens_per_s'), '.4g')}",
                 f"step {_num(rec.get('time_s'), '.3f')} s",
                 f"peak mem {_num(None if rec.get('peak_memory_bytes') is None else rec['peak_memory_bytes'] / 1e9, '.3f')} GB"]
        if rec.get("grad_norm") is not None:
            parts.append(f"grad norm {rec['grad_norm']:.3g}")
        if rec.get("eval_loss") is not None:
            parts.append(f"eval loss {rec['eval_loss']:.4f}")
        return " | ".join(parts)
    if kind == "checkpoint":
        return f"checkpoint step {rec['step']} saved ({rec.get('tag', '')})".replace(" ()", "")
    if kind == "resume":
        return f"resuming from step {rec['step']} (checkpoint {rec.get('dir') or rec.get('tag', '?')})"
    if kind == "rollback":
        return f"rollback at step {rec['step']}: back to step {rec['to']}, skipping batch {rec['skip']}"
    if kind == "eval":
        return f"eval step {rec['step']}: loss {rec['loss']:.4f}"
    return json.dumps(rec)


def alert_rules(job: str = "planner") -> str:
    """Prometheus alerting rules (YAML) with the source article's thresholds."""
    util, lat = ALERT_GPU_UTIL_PERCENT, ALERT_ALLREDUCE_LATENCY_S
    return f"""# Prometheus alerting rules for a planner run (written by `planner run --metrics-port`).
# Thresholds of the source article (issue 10): GPU utilisation below {util}% for {ALERT_GPU_UTIL_FOR};
# all-reduce latency above {lat * 1e3:.0f} ms. Add this file under rule_files: in prometheus.yml and
# scrape the run's endpoint as job "{job}".
groups:
  - name: planner-training
    rules:
      - alert: PlannerGPUUtilizationLow
        expr: planner_gpu_utilization_percent{{job="{job}"}} < {util}
        for: {ALERT_GPU_UTIL_FOR}
        labels:
          severity: warning
        annotations:
          summary: "GPU utilisation of rank {{{{ $labels.rank }}}} below {util}% for {ALERT_GPU_UTIL_FOR}"
          description: "The source article's threshold: a GPU under {util}% busy for {ALERT_GPU_UTIL_FOR} is waiting on data, communication or the host."
      - alert: PlannerAllReduceLatencyHigh
        expr: planner_allreduce_latency_seconds{{job="{job}"}} > {lat}
        for: 1m
        labels:
          severity: warning
        annotations:
          summary: "all-reduce latency of rank {{{{ $labels.rank }}}} above {lat * 1e3:.0f} ms"
          description: "The source article's threshold: mean time per all-reduce call in a step above {lat * 1e3:.0f} ms points at the network."
"""


def _panel(pid: int, title: str, exprs: list[tuple[str, str]], unit: str, x: int, y: int,
           thresholds: float | None = None) -> dict[str, Any]:
    p: dict[str, Any] = {
        "id": pid, "type": "timeseries", "title": title, "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "targets": [{"refId": chr(ord("A") + i), "expr": e, "legendFormat": leg} for i, (e, leg) in enumerate(exprs)],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
    }
    if thresholds is not None:
        p["fieldConfig"]["defaults"]["thresholds"] = {"mode": "absolute", "steps": [
            {"color": "green", "value": None}, {"color": "red", "value": thresholds}]}
        p["fieldConfig"]["defaults"]["custom"] = {"thresholdsStyle": {"mode": "line"}}
    return p


def dashboard(title: str = "planner run") -> dict[str, Any]:
    """A Grafana dashboard (JSON model, schemaVersion 39) with one panel per series family."""
    panels = [
        _panel(1, "Tokens per second", [("planner_tokens_per_second", "tokens/s")], "short", 0, 0),
        _panel(2, "Step time", [("planner_step_time_seconds", "step")], "s", 12, 0),
        _panel(3, "Loss", [("planner_loss", "train"), ("planner_eval_loss", "eval")], "short", 0, 8),
        _panel(4, "Gradient norm", [("planner_grad_norm", "grad norm")], "short", 12, 8),
        _panel(5, "Learning rate", [("planner_learning_rate", "lr")], "short", 0, 16),
        _panel(6, "Peak memory per rank", [("planner_peak_memory_bytes", "rank {{rank}}")], "bytes", 12, 16),
        _panel(7, "all-reduce latency per rank",
               [("planner_allreduce_latency_seconds", "rank {{rank}}")], "s", 0, 24, ALERT_ALLREDUCE_LATENCY_S),
        _panel(8, "Time in all-reduce per step", [("planner_allreduce_seconds", "rank {{rank}}")], "s", 12, 24),
        _panel(9, "GPU utilisation per rank", [("planner_gpu_utilization_percent", "rank {{rank}}")], "percent",
               0, 32, ALERT_GPU_UTIL_PERCENT),
    ]
    return {
        "title": title, "uid": None, "schemaVersion": 39, "version": 1, "editable": True,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "tags": ["planner", "deepspeed"],
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus"}]},
        "panels": panels,
    }
