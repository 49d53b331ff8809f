"""Experiment configs: `base.py` gives every knob's default (from `transformer/config/`); each other
file overrides a few of them."""
