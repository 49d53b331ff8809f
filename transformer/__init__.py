"""sparrow: Transformers in JAX/Flax. `transformer.load(workdir)` reopens a trained run."""

from transformer.api import Model, load

__all__ = ['Model', 'load']
