"""Attention backward: FlashAttention-2 style (Dao, 2023, Alg. 2), two kernels, no atomics.

With P = exp(scale * q k^T - lse) rebuilt from the saved log-sum-exp:

    dV = P^T dO,   dP = dO V^T,   delta = rowsum(dO o O),
    dS = P o (dP - delta),   dQ = scale * dS K,   dK = scale * dS^T Q.

`attn_bwd_dkdv_kernel` owns one key block and walks the query blocks of every query head of
its group (so GQA sums dK/dV over the group without atomics); `attn_bwd_dq_kernel` owns one
query block and walks the key blocks. Results are deterministic.

Out-of-range query rows read lse = +inf (so P = 0) and dO = 0; fully masked rows (lse = -inf)
are mapped to +inf the same way, so they contribute nothing.
"""

import triton
import triton.language as tl

from .common import LOG2E, key_range, load_tile, score_mask, store_tile


@triton.jit
def attn_bwd_preprocess_kernel(
    O,
    DO,
    DELTA,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    H,
    Lq,
    DV: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """delta = rowsum(o * do) in float32, shape (B, H, Lq). Grid: (cdiv(Lq, BLOCK_M), B * H)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    pad = DV != HEAD_DIM_V
    o = load_tile(O + off_b * stride_ob + off_h * stride_oh, offs_m, offs_dv, stride_om,
                  stride_od, Lq, DV, True, pad)  # fmt: skip
    do = load_tile(DO + off_b * stride_dob + off_h * stride_doh, offs_m, offs_dv, stride_dom,
                   stride_dod, Lq, DV, True, pad)  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + pid_bh.to(tl.int64) * Lq + offs_m, delta, mask=offs_m < Lq)


@triton.jit
def _load_row_stats(LSE, DELTA, row_base, offs_m, Lq):
    """lse (base 2, +inf for rows that must give P = 0) and delta for query rows offs_m."""
    lse = tl.load(LSE + row_base + offs_m, mask=offs_m < Lq, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    delta = tl.load(DELTA + row_base + offs_m, mask=offs_m < Lq, other=0.0)
    return lse, delta


@triton.jit
def _attn_bwd_dkdv_inner(
    dk,
    dv,
    k,
    v,
    offs_n,
    q_base,
    do_base,
    LSE,
    DELTA,
    row_base,
    stride_qm,
    stride_qd,
    stride_dom,
    stride_dod,
    lo,
    hi,
    Lq,
    qk_scale,
    D: tl.constexpr,
    DV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = load_tile(q_base, offs_m, offs_d, stride_qm, stride_qd, Lq, D, True, D != HEAD_DIM)
        do = load_tile(
            do_base, offs_m, offs_dv, stride_dom, stride_dod, Lq, DV, True, DV != HEAD_DIM_V
        )
        lse, delta = _load_row_stats(LSE, DELTA, row_base, offs_m, Lq)
        # Transposed scores [BLOCK_N, BLOCK_M] so P^T is never transposed in registers.
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
        if MASK:  # causal diagonal blocks only (key bounds never reach a stored row)
            qk_t = tl.where(offs_m[None, :] >= offs_n[:, None], qk_t, float("-inf"))
        p_t = tl.math.exp2(qk_t - lse[None, :])
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV_OUT,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dkd,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_dvd,
    scale,
    H,
    H_KV,
    GROUP,
    Lq,
    Lk,
    D: tl.constexpr,
    DV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dk, dv for one [BLOCK_N] key block of one kv head. Grid: (cdiv(Lk, BLOCK_N), B * H_KV)."""
    start_n = tl.program_id(0) * BLOCK_N
    pid_bhk = tl.program_id(1)
    off_b = (pid_bhk // H_KV).to(tl.int64)
    off_hk = (pid_bhk % H_KV).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)

    k = load_tile(K + off_b * stride_kb + off_hk * stride_kh, offs_n, offs_d, stride_kn,
                  stride_kd, Lk, D, True, D != HEAD_DIM)  # fmt: skip
    v = load_tile(V + off_b * stride_vb + off_hk * stride_vh, offs_n, offs_dv, stride_vn,
                  stride_vd, Lk, DV, True, DV != HEAD_DIM_V)  # fmt: skip
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V], dtype=tl.float32)
    qk_scale = scale * LOG2E

    if IS_CAUSAL:
        # Rows i >= start_n see this block; rows >= mid see all of it.
        lo = (start_n // BLOCK_M) * BLOCK_M
        mid = tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M
    else:
        lo = 0
        mid = 0
    for g in range(GROUP):
        off_h = off_hk * GROUP + g
        row_base = (off_b * H + off_h) * Lq
        q_base = Q + off_b * stride_qb + off_h * stride_qh
        do_base = DO + off_b * stride_dob + off_h * stride_doh
        for stage in tl.static_range(2):
            if IS_CAUSAL or stage == 1:
                s_lo = lo if stage == 0 else mid
                s_hi = tl.minimum(mid, Lq) if stage == 0 else Lq
                dk, dv = _attn_bwd_dkdv_inner(
                    dk, dv, k, v, offs_n, q_base, do_base, LSE, DELTA, row_base,
                    stride_qm, stride_qd, stride_dom, stride_dod, s_lo, s_hi, Lq, qk_scale,
                    D, DV, HEAD_DIM, HEAD_DIM_V, BLOCK_M, stage == 0, DOT_PRECISION,
                )  # fmt: skip

    dk_base = DK + off_b * stride_dkb + off_hk * stride_dkh
    dv_base = DV_OUT + off_b * stride_dvb + off_hk * stride_dvh
    store_tile(dk_base, (dk * scale).to(DK.dtype.element_ty), offs_n, offs_d, stride_dkn,
               stride_dkd, Lk, D)  # fmt: skip
    store_tile(dv_base, dv.to(DV_OUT.dtype.element_ty), offs_n, offs_dv, stride_dvn,
               stride_dvd, Lk, DV)  # fmt: skip


@triton.jit
def _attn_bwd_dq_inner(
    dq,
    q,
    do,
    lse,
    delta,
    offs_m,
    k_base,
    v_base,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    lo,
    hi,
    Lk,
    qk_scale,
    D: tl.constexpr,
    DV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_tile(k_base, offs_n, offs_d, stride_kn, stride_kd, Lk, D, MASK, D != HEAD_DIM)
        v = load_tile(v_base, offs_n, offs_dv, stride_vn, stride_vd, Lk, DV, MASK, DV != HEAD_DIM_V)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MASK:
            qk = tl.where(score_mask(offs_m, offs_n, Lk, IS_CAUSAL), qk, float("-inf"))
        p = tl.math.exp2(qk - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_dqd,
    scale,
    H,
    GROUP,
    Lq,
    Lk,
    D: tl.constexpr,
    DV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dq for one [BLOCK_M] query block. Grid: (cdiv(Lq, BLOCK_M), B * H)."""
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    off_hk = off_h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)

    q = load_tile(Q + off_b * stride_qb + off_h * stride_qh, offs_m, offs_d, stride_qm,
                  stride_qd, Lq, D, True, D != HEAD_DIM)  # fmt: skip
    do = load_tile(DO + off_b * stride_dob + off_h * stride_doh, offs_m, offs_dv, stride_dom,
                   stride_dod, Lq, DV, True, DV != HEAD_DIM_V)  # fmt: skip
    lse, delta = _load_row_stats(LSE, DELTA, pid_bh.to(tl.int64) * Lq, offs_m, Lq)
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = scale * LOG2E

    full_end, end = key_range(start_m, Lk, BLOCK_M, BLOCK_N, IS_CAUSAL)
    for stage in tl.static_range(2):
        lo = 0 if stage == 0 else full_end
        hi = full_end if stage == 0 else end
        dq = _attn_bwd_dq_inner(
            dq, q, do, lse, delta, offs_m, k_base, v_base,
            stride_kn, stride_kd, stride_vn, stride_vd, lo, hi, Lk, qk_scale,
            D, DV, HEAD_DIM, HEAD_DIM_V, BLOCK_N, stage == 1, IS_CAUSAL, DOT_PRECISION,
        )  # fmt: skip

    store_tile(DQ + off_b * stride_dqb + off_h * stride_dqh, (dq * scale).to(DQ.dtype.element_ty),
               offs_m, offs_d, stride_dqm, stride_dqd, Lq, D)  # fmt: skip
