"""vLLM interop, in one package: omni-pd's side of vLLM's MooncakeConnector protocol.

- `handoff`: the producer description both ways (`VllmProducerInfo`) and the first-handoff checks.
- `layout`: vLLM's CPU KV geometry, and the translation between its blocks and the hf engine's.
- `block_hash`: vLLM 0.32's prefix-cache block hashes (the hf engine names blocks with them).
- `staging`: registered per-layer staging memory in vLLM's layout.
- `pull` (consumer half: read a vLLM producer's blocks) and `source` (the hf decode leg's use
  of it); `serve` and `bootstrap` (producer half: a vLLM consumer reads the hf prefill leg) and
  `consumers` (the hf prefill leg's use of it).
- `producer_info`: what omni-pd's vLLM decode engine reads of its own running connector.

Every mover here goes through the KV transport interface (`kv.transport.KVTransport`).
"""
