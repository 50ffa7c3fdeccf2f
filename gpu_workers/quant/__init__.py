"""Weight formats in the model: fp8 (e4m3, scale per output channel) and int4 (group-wise) linear layers.

The encodings live in ``gpu_workers.formats.weights``; ``tessera quantize`` converts a checkpoint once
(``gpu_workers.tools.quantize``); the loader reads the ``quantization_config`` it writes, or quantises an
unquantised checkpoint while loading it.
"""
