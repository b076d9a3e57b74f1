"""Compatibility only: run directories written before the executor was split (issue 21) name
`planner.executor.worker` in their launch.sh / torchrun.sh. The code lives in planner/runtime."""
