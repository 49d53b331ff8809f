"""`HookPoint`: an identity where an activation is made, which `hooks.run` reads or replaces."""

from __future__ import annotations

import flax.linen as nn
from jax import Array


class HookPoint(nn.Module):
  """Returns its input. The module's path names the activation in TransformerLens's scheme
  (`hooks.hook_name`: .../layer_3/self_attention/hook_z -> blocks.3.attn.hook_z), and
  `hooks.run` intercepts the call to cache the value or replace it. It has no parameters, so
  declaring one changes no checkpoint."""

  @nn.compact
  def __call__(self, x: Array) -> Array:
    return x
