"""FP8 training: block quantizers (``quantize.py``), FP8 GEMMs with their gradients
(``matmul.py``) and the FP8 expert dispatch (``dispatch.py``). ``quantization`` in base.yml
turns them on."""

from MaxText.quantization.matmul import fp8_matmul, linear
from MaxText.quantization.quantize import Recipe, dequantize, fake_quantize, quantize, recipe_of

__all__ = ["Recipe", "dequantize", "fake_quantize", "fp8_matmul", "linear", "quantize", "recipe_of"]
