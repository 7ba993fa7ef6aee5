"""Hugging Face interoperability: config mapping, tensor names and layouts, safetensors I/O."""


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint (or export target) that cannot be used; one line naming the problem."""
