"""Experiment configs: `base.py` holds every knob; each other file overrides a few of them."""
