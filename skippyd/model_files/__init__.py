"""GGUF files: read a model's metadata without loading it, and slice out stage models.

``scan`` parses the header, ``model_info`` reports what a model is, ``slice`` writes stage
slices and caches them. Pure file handling: no llama.cpp, and nothing from the rest of
skippyd.
"""
