"""What is refused, named or prepared before any rank starts (one line naming the field and the
fix, exit 2): checks.py (plan, ds_config.json, host, trainer flags), buildlock.py (stale
torch-extensions build locks), ops.py (DeepSpeed's CPU ops, built once by `make`), lab.py (the
inputs of a measured comparison)."""
