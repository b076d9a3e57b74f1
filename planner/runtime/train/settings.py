"""What a run's flags and plan.json settle before the training loop starts: the data spec, the
DataLoader settings and the learning-rate schedule."""
from __future__ import annotations

from planner.executor.data import DataSpec, Layout


def loader_settings(doc: dict, workers: int | None, device: str):
    """The DataLoader settings of a run: --data-workers when given, else what plan.json records
    under "loader" (planner.executor.loading.choose_loader at search time), else one worker."""
    from planner.executor.loading import LoaderSettings
    rec = doc.get("loader") if isinstance(doc, dict) else None
    if workers is None and isinstance(rec, dict):
        try:
            return LoaderSettings(int(rec["workers"]), bool(rec["pin_memory"]), int(rec["prefetch_factor"]),
                                  rec.get("produce_s"), rec.get("compute_s"), str(rec.get("reason", "")))
        except (KeyError, TypeError, ValueError):
            pass
    n = 1 if workers is None else workers
    return LoaderSettings(n, device == "cuda", 2 if n else 0, reason="--data-workers" if workers is not None
                          else "plan.json records no loader settings: one worker")


def make_loader(rows, layout: Layout, batch_ids: list[int], dp_rank: int, device: str, settings):
    """planner.executor.loading.loader, imported when first needed."""
    from planner.executor.loading import loader as make
    return make(rows, layout, batch_ids, dp_rank, device, settings)


def data_spec(data: str, tokenizer: str, seed: int, trainspec, spec) -> DataSpec:
    """The DataSpec of a run's --data / --tokenizer / --seed: the worker reads this corpus and
    the launcher's preflight checks the same one (planner/executor/preflight.py)."""
    return DataSpec(seq_len=trainspec.seq_len, vocab=spec.vocab, seed=seed, token_file=data, tokenizer=tokenizer)


def configure_lr(cfg: dict, args, steps: int) -> dict:
    """Put the learning-rate schedule of the flags into `cfg` (in memory; ds_config.json on disk
    is left as search wrote it). --lr-schedule unset keeps a "scheduler" block the user put into
    ds_config.json, else it is the constant rate. Returns what metrics.json records."""
    from planner import dsconfig
    lr = args.lr if args.lr is not None else (cfg.get("optimizer", {}).get("params", {}).get("lr")
                                             or dsconfig.OPTIMIZER["lr"])
    if "optimizer" in cfg:
        cfg["optimizer"].setdefault("params", {})["lr"] = lr
    else:  # the client torch AdamW (planner/executor/build.py) reads dsconfig.OPTIMIZER in this process
        dsconfig.OPTIMIZER = {**dsconfig.OPTIMIZER, "lr": lr}
    if args.lr_schedule is None and isinstance(cfg.get("scheduler"), dict):
        source = "ds_config.json"
    else:
        cfg["scheduler"] = dsconfig.lr_scheduler(args.lr_schedule or "constant", lr, args.lr_warmup_steps, steps)
        source = "flags"
    return {"schedule": args.lr_schedule or ("ds_config.json" if source == "ds_config.json" else "constant"),
            "lr": lr, "warmup_steps": args.lr_warmup_steps, "total_steps": steps, "source": source,
            "scheduler": cfg["scheduler"]}
