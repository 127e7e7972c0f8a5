"""Count the matrix-product FLOPs each kernel path issues, on the CPU through Triton's
interpreter: every ``tl.dot`` adds 2 M N K. Printed in units of one L x L x E product over all
heads (2 B H L^2 E), so "7.0" means seven GEMM-sized passes over the score matrix.

    TRITON_INTERPRET=1 python benchmarks/tangent_flops.py

What it shows: the backward through (o, o_t) (issue #18) issues 23 units against the primal
backward's 7 (21 when one kernel pair also gave the tangents' gradients, 3.0x: the time
target's "equal efficiency"; dK_t, dV_t now run through the primal dK/dV kernel, see
kernels/bwd.py), the double backward's part 15 (+ a fwd+JVP pass, 6), and what storing mu in
the forward saves: recomputing it in the backward would need S and S_t again in a pass of its
own, 3 units (+14 %), against 4 bytes per query row and head stored.
"""

from __future__ import annotations

import torch
from triton.runtime import interpreter

from flash_jvp import _ops, _utils
from flash_jvp._utils import Spec

_real_dot = interpreter.InterpreterBuilder.create_dot
_count = {"flops": 0}


def _counting_dot(self, a, b, d, *args):
    m, k = a.data.shape[-2:]
    _count["flops"] += 2 * m * b.data.shape[-1] * k
    return _real_dot(self, a, b, d, *args)


def main() -> None:
    if not _utils.INTERPRET:
        raise SystemExit("run with TRITON_INTERPRET=1 (the count hooks Triton's interpreter)")
    interpreter.InterpreterBuilder.create_dot = _counting_dot
    B, H, L, E = 1, 1, 64, 16  # multiples of the interpreter's tiles (32 x 16): no padding
    unit = 2 * B * H * L * L * E
    torch.manual_seed(0)
    q, k, v, q_t, k_t, v_t, do, do_t = (torch.randn(B, H, L, E) for _ in range(8))
    spec = Spec(E**-0.5)
    o, o_t, lse, mu = _ops.attn_fwd(q, k, v, q_t, k_t, v_t, None, None, spec)
    full = (q, k, v, q_t, k_t, v_t, o, o_t, lse, mu, None, None, spec)
    rows = {
        "forward": lambda: _ops.attn_fwd(q, k, v, None, None, None, None, None, spec),
        "forward + JVP (q_t, k_t, v_t)": lambda: _ops.attn_fwd(
            q, k, v, q_t, k_t, v_t, None, None, spec
        ),  # fmt: skip
        "primal backward (do)": lambda: _ops.attn_bwd(do, q, k, v, o, lse, None, spec),
        "backward through (o, o_t): do, do_t; q_t, k_t, v_t": lambda: _ops.attn_bwd_tangent(
            do, do_t, *full
        ),
        "backward through o_t alone (do_t)": lambda: _ops.attn_bwd_tangent(None, do_t, *full),
        "double backward's part (do_t, no tangent grads)": lambda: _ops.attn_bwd_tangent(
            None, do_t, *full, tangent_grads=False
        ),
        "forward-over-reverse's part (do, do_t, no tangent grads)": lambda: _ops.attn_bwd_tangent(
            do, do_t, *full, tangent_grads=False
        ),
        "through (o, o_t), q_t only": lambda: _ops.attn_bwd_tangent(
            do, do_t, q, k, v, q_t, None, None, o, o_t, lse, mu, None, None, spec
        ),
        "through (o, o_t), v_t only": lambda: _ops.attn_bwd_tangent(
            do, do_t, q, k, v, None, None, v_t, o, o_t, lse, mu, None, None, spec
        ),
    }
    for name, fn in rows.items():
        _count["flops"] = 0
        fn()
        print(f"{name:60s} {_count['flops'] / unit:5.1f} GEMM units")


if __name__ == "__main__":
    main()
