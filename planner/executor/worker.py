"""`python -m planner.executor.worker`, as launch.sh / torchrun.sh written before issue 21's split
start it: the training worker, planner/runtime/train/worker.py."""
import sys

from planner.runtime.train.worker import main

if __name__ == "__main__":
    sys.exit(main())
