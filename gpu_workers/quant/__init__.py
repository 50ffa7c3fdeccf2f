"""Weight formats (bf16, fp8 e4m3 per output channel, int4 group-wise), their linear layers, and conversion.

``tessera quantize`` converts a checkpoint once (``checkpoint.quantize_checkpoint``); the loader reads the
``quantization_config`` it writes, or quantises an unquantised checkpoint while loading it.
"""
