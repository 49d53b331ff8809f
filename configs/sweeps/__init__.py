"""Sweep files: one claim each, `get_sweep(scale) -> dict` (see transformer/research/sweeps.py)."""
