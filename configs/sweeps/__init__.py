"""Sweep files: one claim each, `get_sweep(scale) -> dict` (see research/sweeps.py)."""
