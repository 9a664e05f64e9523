"""The stager: turns a Hugging Face checkpoint into per-rank artifacts that vLLM loads directly.

Importing this package is cheap and torch-free; the heavy parts import lazily.
"""
