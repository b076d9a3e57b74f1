"""What a run measures and shows: metrics.py (metrics.json beside the estimate), measure.py (peak
memory, model states by class), allocated.py (allocated peak on CPU), monitor.py (NaN, spikes,
stalls), watch.py (progress line, all-reduce timer, alert rules, dashboard), prom.py (Prometheus)."""
