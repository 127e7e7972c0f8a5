"""One long-context sCM step on the GPU (target 5 of the performance issue): fwd+JVP+bwd at
B=1, H=16, L=131072, E=128, bf16, against flash SDPA fwd+bwd; time and peak memory of each,
measured as ``python -m flash_jvp bench`` measures (``bench._measure``).

    python benchmarks/long_context.py [--L 131072]
"""

from __future__ import annotations

import argparse

from flash_jvp import bench


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--L", type=int, default=131072)
    args = parser.parse_args()
    s = bench.Shape(1, 16, args.L, 128, False)
    flash = bench._backend(bench.SDPBackend.FLASH_ATTENTION)
    for method, mode, factory in (
        ("flash_jvp", "fwd+jvp+bwd", lambda s: bench._jvp_bwd(bench.attention, s)),
        ("sdpa_flash", "fwd+bwd", lambda s: bench._fwd_bwd(flash, s)),
    ):
        ms, peak, note = bench._measure(factory, s)
        tflops = s.flops(mode) / (ms * 1e-3) / 1e12
        print(f"{method:10} {mode:12} B1 H16 L{s.L} E128 bf16: {ms:9.1f} ms {tflops:6.1f} "
              f"TFLOP/s, peak {peak:.2f} GiB above the inputs {note}")  # fmt: skip


if __name__ == "__main__":
    main()
