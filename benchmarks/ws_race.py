"""Issue 25: do the warp-specialised forward's wrong calls go with Triton < 3.8's unused
barriers (kernels/ws_barriers.py)? Repeated fwd+JVP calls on the same inputs, each compared
bit for bit with the first; one process per (variant, fix), each with its own Triton cache
(the compile hook is not part of Triton's cache key):

    python -m benchmarks.ws_race VARIANT FIX [CALLS]

VARIANT: off (no warp specialisation), base (E=128, 128x64, 4 warps, 2 stages: f3a36c7's),
t128 (E=64, 128x128, 4 warps, 2 stages: 031b0f9's). FIX: 1 removes the unused barriers, 0
keeps them. Shapes: B1 H32 L4096 bf16, GQA 32/8 causal and MHA non-causal. For each call
that differs it prints how many rows and NaNs, and for rows without NaN how well key 0 alone
explains the change (cosine of o - o_first with v_0 - o_rest per row; 1.0: only the score of
key 0, whose first 16 bytes share memory with the unused barriers, moved).
"""

import os
import sys
import tempfile

variant, fix = sys.argv[1], sys.argv[2]
calls = int(sys.argv[3]) if len(sys.argv) > 3 else 300
os.environ["FLASH_JVP_WS_BARRIER_FIX"] = fix
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"ws-race-{variant}-{fix}-")

import torch  # noqa: E402

import flash_jvp  # noqa: E402
from flash_jvp.kernels import configs  # noqa: E402
from flash_jvp.kernels.configs import Config  # noqa: E402

VARIANTS = {
    "off": ({}, (64, 128)),
    "base": ({"fwd+jvp": {128: Config(128, 64, 4, 2, tma=True, ws=True)}}, (128,)),
    "t128": ({"fwd+jvp": {64: Config(128, 128, 4, 2, tma=True, ws=True)}}, (64,)),
}
table, dims = VARIANTS[variant]
configs._WARP_SPECIALISED[False].clear()
configs._WARP_SPECIALISED[True].clear()
for causal in (False, True):
    configs._WARP_SPECIALISED[causal].update(table)


def key0_cosine(q, k, v, o, o_first, rows, causal, scale):
    """Per (b, h, row) in ``rows``: cosine of o - o_first with v_0 - (o without key 0)."""
    group = q.shape[1] // k.shape[1]
    out = []
    for b, h, r in rows.tolist():
        kh = h // group
        s = (q[b, h, r].float() @ k[b, kh].float().T) * scale
        if causal:
            s[r + 1 :] = float("-inf")
        p = torch.softmax(s, 0)
        rest = (p[1:, None] * v[b, kh, 1:].float()).sum(0) / (1 - p[0])
        d = o[b, h, r].float() - o_first[b, h, r].float()
        out.append(torch.nn.functional.cosine_similarity(d, v[b, kh, 0].float() - rest, 0).item())
    return out


for E in dims:
    for Hkv, causal in ((8, True), (32, False)):
        torch.manual_seed(0)
        q, qt = (torch.randn(1, 32, 4096, E, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v, kt, vt = (
            torch.randn(1, Hkv, 4096, E, device="cuda", dtype=torch.bfloat16) for _ in range(4)
        )

        def f(a, b, c, causal=causal):
            return flash_jvp.attention(a, b, c, is_causal=causal, enable_gqa=True)

        ref = torch.func.jvp(f, (q, k, v), (qt, kt, vt))
        bad = 0
        for i in range(calls):
            out = torch.func.jvp(f, (q, k, v), (qt, kt, vt))
            if all(torch.equal(a, b) for a, b in zip(out, ref)):
                continue
            bad += 1
            for name, a, b in zip(("o", "o_t"), out, ref):
                rows = (a != b).any(-1).nonzero()
                if len(rows) == 0:
                    continue
                nan = int(a.isnan().sum())
                line = f"  call {i} {name}: {len(rows)} rows differ, {nan} NaN"
                finite = rows[~a[rows[:, 0], rows[:, 1], rows[:, 2]].isnan().any(-1)]
                if name == "o" and len(finite):
                    cos = key0_cosine(q, k, v, a, b, finite[:8], causal, E**-0.5)
                    line += f", key-0 cosine of the first rows {[round(c, 4) for c in cos]}"
                print(line, flush=True)
        print(
            f"{variant} fix={fix} E{E} Hkv{Hkv} causal={causal}: {bad} of {calls} calls differ",
            flush=True,
        )
