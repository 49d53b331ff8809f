"""Inference: `Model` and `load` for notebooks, and Hugging Face import/export."""
