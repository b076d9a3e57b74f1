"""`python -m planner` is the `planner` command."""
from planner.cli import entry

if __name__ == "__main__":
    entry()
