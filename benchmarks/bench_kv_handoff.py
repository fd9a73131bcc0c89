"""KV handoff speed against what the wire allows, measured in one run on this machine.

For each KV geometry and prompt length it times, over loopback Mooncake (tcp):
  wire    one raw Mooncake read of the same number of bytes between two registered buffers
  copy    an in-process memory copy of those bytes (the floor no transport beats)
  publish the prefill side's pack + checksum into its registered pool
  fetch   the decode side's read + verify + unpack (what a request waits for)
and prints fetch/wire and (publish+fetch)/wire ratios.

    .venv/bin/python benchmarks/bench_kv_handoff.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import torch  # noqa: E402

from omni_pd.kv import BlockLayout, KVDescriptor, KVReceiver, KVSender, MooncakeTransport  # noqa: E402

GEOMETRIES = {
    # name: (layers, kv_heads, head_dim, dtype)
    "tiny-qwen3-omni thinker": (4, 2, 16, "float32"),
    "Qwen3-Omni-30B-A3B thinker": (48, 4, 128, "bfloat16"),
}
PROMPTS = (256, 1024, 4096)


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (first contact with a peer costs a handshake)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def run(repeats: int) -> None:
    sender_transport, receiver_transport = MooncakeTransport(), MooncakeTransport()
    print(f"{'geometry':28} {'tokens':>6} {'MiB':>8} {'copy ms':>8} {'wire ms':>8} "
          f"{'publish':>8} {'fetch':>8} {'fetch/wire':>10} {'total/wire':>10}")
    for name, (layers, heads, dim, dtype) in GEOMETRIES.items():
        layout = BlockLayout.default_for(layers, heads, dim, dtype, block_size=16)
        max_tokens = max(PROMPTS)
        blocks = layout.num_blocks_for(max_tokens) + 1
        sender = KVSender("bench-prefill", layout, blocks, sender_transport, lease_timeout_s=600)
        receiver = KVReceiver(layout, blocks, receiver_transport)
        # Wire baseline buffers, registered like the pools.
        nbytes = max_tokens * layout.bytes_per_token
        src = torch.zeros(nbytes, dtype=torch.uint8)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        sender_transport.register(src.data_ptr(), nbytes)
        receiver_transport.register(dst.data_ptr(), nbytes)
        try:
            for tokens in PROMPTS:
                size = tokens * layout.bytes_per_token
                kv = torch.randn(layers, 2, heads, tokens, dim).to(layout.torch_dtype)
                copy_ms = _median_ms(lambda: dst[:size].copy_(src[:size]), repeats)
                wire_ms = _median_ms(lambda: receiver_transport.read(
                    sender_transport.session_id, [(dst.data_ptr(), src.data_ptr(), size)]), repeats)
                descriptors: list[KVDescriptor] = []

                def publish():
                    if descriptors:
                        sender.release(descriptors.pop().transfer_id)
                    descriptors.append(sender.publish(f"bench-{tokens}", kv))

                publish_ms = _median_ms(publish, repeats)
                fetched = receiver.fetch(descriptors[0])
                assert torch.equal(fetched.kv_canonical, kv), "handoff changed the KV"
                fetch_ms = _median_ms(lambda: receiver.fetch(descriptors[0]), repeats)
                sender.release(descriptors.pop().transfer_id)
                print(f"{name:28} {tokens:>6} {size / 2**20:>8.2f} {copy_ms:>8.2f} {wire_ms:>8.2f} "
                      f"{publish_ms:>8.2f} {fetch_ms:>8.2f} {fetch_ms / wire_ms:>10.2f} "
                      f"{(publish_ms + fetch_ms) / wire_ms:>10.2f}")
        finally:
            sender.close()
            receiver.close()
            sender_transport.unregister(src.data_ptr())
            receiver_transport.unregister(dst.data_ptr())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    run(parser.parse_args().repeats)
