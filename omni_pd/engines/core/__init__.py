"""The generic engine core: requests, scheduling, KV management, the P/D legs and the chunked
decoder loop, for any model whose package provides a runner (runner.py)."""
