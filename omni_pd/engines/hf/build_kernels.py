"""`python -m omni_pd.engines.hf.build_kernels`: build every C kernel ahead of the first request
(the engines' own and those the registered models declare); `scripts/setup.sh` runs it."""

from __future__ import annotations

from ... import registry
from .attention_native import ATTENTION
from .experts_native import EXPERTS
from .native_build import build


def main() -> None:
    for kernel in (ATTENTION, EXPERTS, *registry.native_kernels()):
        print(build(kernel))


if __name__ == "__main__":
    main()
