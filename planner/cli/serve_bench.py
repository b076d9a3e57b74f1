"""`planner serve-bench`: measure one serving deployment on this machine (planner.runtime.serve.run)."""
from __future__ import annotations

import click

from planner.cli.common import load_model, model_options


@click.command("serve-bench")
@model_options
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel ranks (gloo processes).")
@click.option("--max-batch", type=int, default=4, show_default=True, help="KV-cache slots: sequences decoded together.")
@click.option("--prompt-len", type=int, default=32, show_default=True, help="Median prompt tokens.")
@click.option("--output-len", type=int, default=16, show_default=True, help="Median generated tokens per request.")
@click.option("--prompt-sigma", type=float, default=0.0, show_default=True, help="Log-normal sigma of prompt lengths.")
@click.option("--output-sigma", type=float, default=0.0, show_default=True, help="Log-normal sigma of output lengths.")
@click.option("--rate", type=float, default=4.0, show_default=True, help="Poisson arrival rate, requests/s.")
@click.option("--requests", type=int, default=32, show_default=True, help="Requests sent.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds arrivals and prompts.")
@click.option("--timeout", type=float, default=120.0, show_default=True,
              help="Seconds of serving; requests still running then are dropped.")
@click.option("--precision", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True)
@click.option("--threads", type=int, default=None, help="Torch threads per rank [default: the cores over the TP ranks].")
@click.option("--out", default="reports/serve_bench", show_default=True, help="Directory for serve_metrics.json.")
def serve_bench(model_arg, scale, tp, max_batch, prompt_len, output_len, prompt_sigma, output_sigma, rate, requests,
                seed, timeout, precision, threads, out) -> None:
    """Serve seeded requests with Poisson arrivals on the executor's model (KV cache, continuous
    batching, TP across processes) and write OUT/serve_metrics.json."""
    from planner.runtime.serve.run import METRICS_FILE, run_serving
    from planner.serve.spec import Workload
    spec = load_model(model_arg, scale)
    workload = Workload(prompt_len=prompt_len, output_len=output_len, prompt_sigma=prompt_sigma,
                        output_sigma=output_sigma, seed=seed)
    m = run_serving(spec, tp=tp, max_batch=max_batch, workload=workload, rate_qps=rate, requests=requests, seed=seed,
                    timeout_s=timeout, precision=precision, out_dir=out, threads=threads)
    ms = lambda d, k: "n/a" if d[k] is None else f"{1e3 * d[k]:.2f} ms"  # noqa: E731
    click.echo(f"{spec.name} TP {tp} max batch {max_batch} at {rate:g} req/s: {m['requests']}/{m['requests_offered']} "
               f"requests, TTFT p50 {ms(m['ttft_s'], 'p50')} p99 {ms(m['ttft_s'], 'p99')}, TPOT p50 "
               f"{ms(m['tpot_s'], 'p50')}, achieved {m['achieved_qps']:.2f} req/s"
               + (" (timed out)" if m["timed_out"] else ""))
    click.echo(f"wrote {out}/{METRICS_FILE}")
