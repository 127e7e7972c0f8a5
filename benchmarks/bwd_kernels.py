"""Every CUDA kernel of flash_jvp's backward beside cuDNN SDPA's, by device time (Hopper; ~30 s).

    python benchmarks/bwd_kernels.py [--length 8192]

B=4, bf16, (H, E) = (16, 64) and (8, 128), causal and not: the backward of one forward run
10 times under torch.profiler, each kernel's mean time per backward.
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import flash_jvp


def kernel_times(attention, q, k, v, do) -> list[tuple[str, float, int]]:
    """(kernel, ms per backward, launches per backward), largest first."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    o = attention(q, k, v)

    def run():
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            run()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    return [(e.key, e.device_time_total / 10 / 1000, e.count // 10) for e in events]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    args = parser.parse_args()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for E, H in ((64, 16), (128, 8)):
        for causal in (False, True):
            q, k, v, do = (torch.randn(4, H, args.length, E, device="cuda", dtype=torch.bfloat16)
                           for _ in range(4))  # fmt: skip
            for name, f in (("flash_jvp", flash_jvp.attention), ("cudnn", sdpa)):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    rows = kernel_times(functools.partial(f, is_causal=causal), q, k, v, do)
                total = sum(ms for _, ms, _ in rows)
                print(f"E{E} L{args.length} causal {causal} {name}: {total:.3f} ms")
                for key, ms, n in rows:
                    print(f"  {ms:8.3f} ms x{n} {key[:100]}")


if __name__ == "__main__":
    main()
