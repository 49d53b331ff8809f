"""sparrow: Transformers in JAX/Flax, small enough to read in an afternoon.

The public surface:
  transformer.load(path)                  a trained run (or an imported model), ready to use
  transformer.dot_product_attention(...)  the one attention core, with its implementations
  transformer.MaskSpec                    structured masks: causal, segments, sliding window
  transformer.ModelConfig                 the frozen, validated model config
  transformer.build(cfg)                  the Flax module of a config's family

The rooms, whose imports point one way: `data` <- `model` <- `training` <- `inference`, over
`config`, `sharding`, `util` and `kernels`. The tools beside the library (`bench/`, `research/`)
import it and are never imported by it (docs/architecture.md; tests/test_layout.py).
"""

from transformer.config import ModelConfig
from transformer.inference.api import Model, load
from transformer.kernels.masks import MaskSpec
from transformer.model.attention import dot_product_attention
from transformer.model.models import build

__all__ = ['MaskSpec', 'Model', 'ModelConfig', 'build', 'dot_product_attention', 'load']
