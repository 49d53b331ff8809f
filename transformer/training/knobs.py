"""Checks of an experiment's knobs for callers that hold a ConfigDict (tests, notebooks): each is
`Config.from_configdict`, which every run calls once before any work."""

from __future__ import annotations

import ml_collections

from transformer.config.experiment import Config


def resolve_lengths(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Sets the context once: data.max_length (an LM's row) follows model.max_length unless given
  (as `Config.from_configdict` resolves it), after checking every knob. Returns `config`, changed
  in place."""
  config.data.max_length = Config.from_configdict(config).data.max_length
  return config


def check_config(config: ml_collections.ConfigDict) -> Config:
  """Raises one ValueError naming the first knob of `config` that cannot work; returns the typed
  experiment."""
  return Config.from_configdict(config)
