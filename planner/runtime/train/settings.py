"""What a run's flags settle before the training loop starts: the learning-rate schedule (the data
spec and loader settings: planner/data/corpus.py data_spec, planner/data/loader.py loader_settings)."""
from __future__ import annotations


def configure_lr(cfg: dict, opts, steps: int) -> dict:
    """Put the learning-rate schedule of the flags into `cfg` (in memory; ds_config.json on disk
    is left as search wrote it). --lr-schedule unset keeps a "scheduler" block the user put into
    ds_config.json, else it is the constant rate. Returns what metrics.json records."""
    from planner import dsconfig
    lr = opts.lr if opts.lr is not None else (cfg.get("optimizer", {}).get("params", {}).get("lr")
                                             or dsconfig.OPTIMIZER["lr"])
    if "optimizer" in cfg:
        cfg["optimizer"].setdefault("params", {})["lr"] = lr
    else:  # the client torch AdamW (planner/runtime/train/build.py) reads dsconfig.OPTIMIZER in this process
        dsconfig.OPTIMIZER = {**dsconfig.OPTIMIZER, "lr": lr}
    if opts.lr_schedule is None and isinstance(cfg.get("scheduler"), dict):
        source = "ds_config.json"
    else:
        cfg["scheduler"] = dsconfig.lr_scheduler(opts.lr_schedule or "constant", lr, opts.lr_warmup_steps, steps)
        source = "flags"
    return {"schedule": opts.lr_schedule or ("ds_config.json" if source == "ds_config.json" else "constant"),
            "lr": lr, "warmup_steps": opts.lr_warmup_steps, "total_steps": steps, "source": source,
            "scheduler": cfg["scheduler"]}
