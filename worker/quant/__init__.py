"""Low-precision weights: ``QuantizedWeight`` (codes, group scales, zeros), the methods
that make one from a float weight (``method.py``'s registry: int8, int4, fp8, nvfp4),
GGUF's blocks read as they ship (``gguf.py``), and the matmul that decodes them inside
the kernel (``matmul.py``, ``worker/kernels/quant_linear.cpp``). Activations and the KV
cache stay in the model's dtype."""
