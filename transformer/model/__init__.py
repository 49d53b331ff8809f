"""The model: one attention core, masks, positions, layers, the three families, objectives and
KV-cache decoding."""
