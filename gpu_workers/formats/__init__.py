"""Number formats below everything that stores or computes with them: FP8-e4m3 elements (``fp8``) and the
FP8 / INT4 weight encodings (``weights``). Imports nothing else of the project."""
