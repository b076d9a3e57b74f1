"""What the training loop patches into a DeepSpeed engine: the test hooks of worker
--save-sleep and --dump-grads, and the pipeline's forward recorder of --measure-activations."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from planner.runtime.observe.measure import ActivationRecorder


def slow_saves(engine, seconds: float) -> dict:
    """Test hook (worker --save-sleep S): sleep after each checkpoint file DeepSpeed writes (in
    saves after step 0), so a kill lands in the middle of a save. Returns the switch."""
    ce = engine.checkpoint_engine
    save = ce.save
    switch = {"on": False}

    def slow(state_dict, path):
        out = save(state_dict, path)
        if switch["on"]:
            time.sleep(seconds)
        return out
    ce.save = slow
    return switch


def record_first_forward(engine, recorder: ActivationRecorder) -> None:
    """Under a pipeline, DeepSpeed's PipelineEngine runs each micro-batch's forward (and, on the
    last stage, its loss) in _exec_forward_pass, dispatched through _INSTRUCTION_MAP: record the
    first one after `recorder.armed` is set."""
    from deepspeed.runtime.pipe.schedule import ForwardPass
    forward = type(engine)._INSTRUCTION_MAP[ForwardPass]
    recorder.armed = False

    def recorded(self, buffer_id):
        if not recorder.armed:
            return forward(self, buffer_id)
        recorder.armed = False
        with recorder.window():
            return forward(self, buffer_id)

    engine._INSTRUCTION_MAP = {**type(engine)._INSTRUCTION_MAP, ForwardPass: recorded}


def dump_first_grads(engine, out: Path, rank: int, coords: tuple[int, int, int]) -> None:
    """Test hook (worker --dump-grads DIR): just before the first optimizer step, write this
    rank's gradients as the optimizer sees them (averaged over DP; with ZeRO, DeepSpeed's
    safe_get_full_grad gathers this rank's whole TP slice), with what is needed to reassemble
    them across TP (`tp_split`) and the global gradient norm the step used."""
    from deepspeed.utils import safe_get_full_grad
    take_step = engine._take_model_step
    done = []

    def dump_then_step(*args, **kw):
        if done:
            return take_step(*args, **kw)
        grads = [{"name": p.canonical, "split": p.tp_split, "pipe_replicated": bool(getattr(p, "ds_pipe_replicated", False)),
                  "grad": safe_get_full_grad(p).detach().float().cpu().clone()} for p in engine.module.parameters()]
        result = take_step(*args, **kw)
        norm = engine.get_global_grad_norm()
        done.append(True)
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"rank": rank, "coords": list(coords), "grads": grads,
                    "grad_norm": float(norm.item() if isinstance(norm, torch.Tensor) else norm)},
                   out / f"rank{rank}.pt")
        return result

    engine._take_model_step = dump_then_step
