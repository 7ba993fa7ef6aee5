"""Transformer building blocks: norms, rotary/YaRN embeddings, MLA attention, SwiGLU MLP."""
