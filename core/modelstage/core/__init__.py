"""The core both images and the loader plugin share: torch-free, stager-free.

Errors, the artifact digest, the format table, vLLM's layouts, the manifest and its
verification, the safetensors header codec and the S3 client (docs/architecture.md).
"""
