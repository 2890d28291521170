"""The runtime: accounted device/host memory for chunks (chunk_store), chunk-wise Adam (adam), the executor."""
