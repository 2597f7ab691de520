"""Ahead of time: a config's steps lowered (StableHLO, `lower.py`) for an accelerator on a machine without one."""
