"""Training the default model: a small Llama trained on the Python standard library's own source code.

``python -m gpu_workers.tools.train.pycode --out models/pycode-tiny`` reproduces ``models/pycode-tiny``.
"""
