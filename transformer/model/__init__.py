"""The model: one attention core, masks, positions, layers, the three families, objectives and
KV-cache decoding."""

# The families beside GPT's (models.py) add themselves to models.FAMILIES when imported.
from transformer.model import bidirectional, encoder_decoder  # noqa: F401
