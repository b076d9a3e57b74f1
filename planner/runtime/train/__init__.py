"""Training a plan: launch.py starts the ranks on this machine and watches them (group_launch.py:
through the deepspeed launcher on a node group); worker.py is one rank, loop.py its training loop
(build.py builds the engine and loader; checkpoints.py, evaluate.py, hooks.py, settings.py,
stepsync.py the per-step collective, result.py each rank's measurements and result.json);
verify.py runs the baseline and the plan back to back."""
