"""The target runtime: loading targets, the lean forward, compiled CPU kernels, KV caches, block codes."""
