"""Attention backward: FlashAttention-2 style (Dao, 2023, Alg. 2), two kernels.

With P = exp(scale * q k^T - lse) rebuilt from the saved log-sum-exp:

    dV = P^T dO,   dP = dO V^T,   delta = rowsum(dO o O),
    dS = P o (dP - delta),   dQ = scale * dS K,   dK = scale * dS^T Q.

`attn_bwd_dkdv_kernel` owns one key block and walks the query blocks of every query head of
its group (so GQA sums dK/dV over the group without atomics); `attn_bwd_dq_kernel` owns one
query block and walks the key blocks. dq, dk, dv are deterministic (no atomics).

Out-of-range query rows read lse = +inf (so P = 0) and dO = 0; fully masked rows (lse = -inf)
are mapped to +inf the same way, so they contribute nothing. An attn_mask is applied as in the
forward, with the same block skipping; the gradient of an additive mask is dS itself, summed
over the mask's broadcast dims with fp32 atomic adds by the dq kernel. Packed batches
(VARLEN) as in the forward.
"""

import triton
import triton.language as tl

from .common import (
    LOG2E,
    aligned,
    apply_mask,
    block_range,
    dot_split,
    key_range,
    load_mask,
    load_split,
    load_tile,
    mask_range,
    score_mask,
    seq_bounds,
    store_split,
)


@triton.jit
def attn_bwd_preprocess_kernel(
    O,
    DO,
    DELTA,
    CU_SEQLENS_Q,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    stride_lb,
    stride_lh,
    H,
    Lq,
    DV: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    VARLEN: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr,
):
    """delta = rowsum(o * do) in float32, laid out like lse. Grid: (cdiv(Lq, BLOCK_M), B * H)."""
    stride_om, stride_dom = aligned(stride_om, STRIDE_ALIGN), aligned(stride_dom, STRIDE_ALIGN)
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    q_start, Lq, _, _ = seq_bounds(CU_SEQLENS_Q, CU_SEQLENS_Q, off_b, Lq, Lq, VARLEN)
    if start_m >= Lq:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    pad = DV != HEAD_DIM_V
    o = load_tile(O + off_b * stride_ob + off_h * stride_oh + q_start * stride_om, offs_m, offs_dv,
                  stride_om, stride_od, Lq, DV, True, pad)  # fmt: skip
    do = load_tile(DO + off_b * stride_dob + off_h * stride_doh + q_start * stride_dom, offs_m,
                   offs_dv, stride_dom, stride_dod, Lq, DV, True, pad)  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row_base = off_b * stride_lb + off_h * stride_lh + q_start
    tl.store(DELTA + row_base + offs_m, delta, mask=offs_m < Lq)


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
    dk2,
    dv,
    dv2,
    k,
    k2,
    v,
    v2,
    offs_n,
    q_base,
    do_base,
    mask_base,
    LSE,
    DELTA,
    row_base,
    stride_qm,
    stride_qd,
    stride_dom,
    stride_dod,
    stride_mm,
    stride_mn,
    lo,
    hi,
    Lq,
    Lk,
    causal_offset,
    qk_scale,
    mask_min,
    D: tl.constexpr,
    DV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_TAIL: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MASK: tl.constexpr,
    MASK_KIND: tl.constexpr,
    MASK_SAME_ROWS: tl.constexpr,
    MASK_SAME_COLS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q, q2 = load_split(q_base, offs_m, stride_qm, stride_qd, Lq, D, HEAD_DIM, HEAD_DIM_TAIL,
                           True)  # fmt: skip
        do, do2 = load_split(do_base, offs_m, stride_dom, stride_dod, Lq, DV, HEAD_DIM_V,
                             HEAD_DIM_V_TAIL, True)  # fmt: skip
        lse, delta = _load_row_stats(LSE, DELTA, row_base, offs_m, Lq)
        # Transposed scores [BLOCK_N, BLOCK_M] so P^T is never transposed in registers.
        qk_t = dot_split(k, k2, q, q2, None, HEAD_DIM_TAIL, DOT_PRECISION) * qk_scale
        if MASK:  # causal diagonal blocks only (key bounds never reach a stored row)
            qk_t = tl.where(offs_m[None, :] + causal_offset >= offs_n[:, None], qk_t, float("-inf"))
        if MASK_KIND != 0:  # the mask tile transposed: rows are keys, columns query rows
            vals = load_mask(mask_base, offs_n, offs_m, stride_mn, stride_mm, Lk, Lq,
                             MASK_SAME_COLS, MASK_SAME_ROWS)  # fmt: skip
            qk_t = apply_mask(qk_t, vals, mask_min, MASK_KIND)
        p_t = tl.math.exp2(qk_t - lse[None, :])
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        if HEAD_DIM_V_TAIL > 0:
            dv2 = tl.dot(p_t.to(do.dtype), do2, dv2, input_precision=DOT_PRECISION)
        dp_t = dot_split(v, v2, do, do2, None, HEAD_DIM_V_TAIL, DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
        if HEAD_DIM_TAIL > 0:
            dk2 = tl.dot(ds_t.to(q.dtype), q2, dk2, input_precision=DOT_PRECISION)
    return dk, dk2, dv, dv2


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
    MASK,
    Q_RANGES,
    CU_SEQLENS_Q,
    CU_SEQLENS_K,
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
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    stride_rb,
    stride_rh,
    stride_rg,
    stride_lb,
    stride_lh,
    scale,
    mask_min,
    causal_offset,
    H,
    H_KV,
    GROUP,
    Lq,
    Lk,
    D: tl.constexpr,
    DV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_TAIL: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    MASK_KIND: tl.constexpr,
    MASK_SAME_ROWS: tl.constexpr,
    MASK_SAME_COLS: tl.constexpr,
    MASK_SPLIT: tl.constexpr,
    VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr,
):
    """dk, dv for one [BLOCK_N] key block of one kv head. Grid: (cdiv(Lk, BLOCK_N), B * H_KV)."""
    stride_qm, stride_dom = aligned(stride_qm, STRIDE_ALIGN), aligned(stride_dom, STRIDE_ALIGN)
    stride_kn, stride_vn = aligned(stride_kn, STRIDE_ALIGN), aligned(stride_vn, STRIDE_ALIGN)
    stride_dkn, stride_dvn = aligned(stride_dkn, STRIDE_ALIGN), aligned(stride_dvn, STRIDE_ALIGN)
    LOOP_MASK_KIND: tl.constexpr = 0 if MASK_SPLIT == 1 else MASK_KIND  # see fwd.py
    start_n = tl.program_id(0) * BLOCK_N
    pid_bhk = tl.program_id(1)
    off_b = (pid_bhk // H_KV).to(tl.int64)
    off_hk = (pid_bhk % H_KV).to(tl.int64)
    q_start, Lq, k_start, Lk = seq_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, off_b, Lq, Lk, VARLEN)
    if start_n >= Lk:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)

    k, k2 = load_split(K + off_b * stride_kb + off_hk * stride_kh + k_start * stride_kn, offs_n,
                       stride_kn, stride_kd, Lk, D, HEAD_DIM, HEAD_DIM_TAIL, True)  # fmt: skip
    v, v2 = load_split(V + off_b * stride_vb + off_hk * stride_vh + k_start * stride_vn, offs_n,
                       stride_vn, stride_vd, Lk, DV, HEAD_DIM_V, HEAD_DIM_V_TAIL, True)  # fmt: skip
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V], dtype=tl.float32)
    dk2, dv2 = dk, dv  # the tail columns' (unused without a tail)
    if HEAD_DIM_TAIL > 0:
        dk2 = tl.zeros([BLOCK_N, HEAD_DIM_TAIL], dtype=tl.float32)
    if HEAD_DIM_V_TAIL > 0:
        dv2 = tl.zeros([BLOCK_N, HEAD_DIM_V_TAIL], dtype=tl.float32)
    qk_scale = scale * LOG2E

    if IS_CAUSAL:
        # Rows i >= start_n - causal_offset see this block; rows >= mid see all of it.
        lo = (tl.maximum(start_n - causal_offset, 0) // BLOCK_M) * BLOCK_M
        mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - causal_offset, 0), BLOCK_M) * BLOCK_M
    else:
        lo = 0
        mid = 0
    if MASK_KIND == 1:  # boolean: two launches (see fwd.py); a program is "dense" when the
        # mask gives this key block exactly rows [lo, hi) in every head of the group
        all_dense = start_n >= 0
        for g in range(GROUP):
            r_lo, r_hi, dense = mask_range(Q_RANGES, stride_rb, stride_rh, stride_rg, off_b,
                                           off_hk * GROUP + g, start_n, Lk, BLOCK_N)  # fmt: skip
            all_dense = all_dense & dense & (r_lo % BLOCK_M == 0)
        if MASK_SPLIT == 1:
            if all_dense == 0:
                return
        else:
            if all_dense != 0:
                return
    for g in range(GROUP):
        off_h = off_hk * GROUP + g
        row_base = off_b * stride_lb + off_h * stride_lh + q_start
        q_base = Q + off_b * stride_qb + off_h * stride_qh + q_start * stride_qm
        do_base = DO + off_b * stride_dob + off_h * stride_doh + q_start * stride_dom
        mask_base = MASK + off_b * stride_mb + off_h * stride_mh
        r_lo, r_hi, q_bound, _ = block_range(Q_RANGES, stride_rb, stride_rh, stride_rg, off_b,
                                             off_h, start_n, Lk, Lq, BLOCK_N, BLOCK_M, MASK_KIND,
                                             MASK_SPLIT)  # fmt: skip
        # causal diagonal blocks [lo, mid) with the causal mask, then the rest without it
        for stage in tl.static_range(2):
            if IS_CAUSAL or stage == 1:
                s_lo = tl.maximum(lo, r_lo) if stage == 0 else tl.maximum(mid, r_lo)
                s_hi = (
                    tl.minimum(tl.minimum(mid, q_bound), r_hi)
                    if stage == 0
                    else tl.minimum(q_bound, r_hi)
                )
                dk, dk2, dv, dv2 = _attn_bwd_dkdv_inner(
                    dk, dk2, dv, dv2, k, k2, v, v2, offs_n, q_base, do_base, mask_base, LSE,
                    DELTA, row_base, stride_qm, stride_qd, stride_dom, stride_dod, stride_mm,
                    stride_mn, s_lo, s_hi, q_bound, Lk, causal_offset, qk_scale, mask_min,
                    D, DV, HEAD_DIM, HEAD_DIM_TAIL, HEAD_DIM_V, HEAD_DIM_V_TAIL, BLOCK_M,
                    stage == 0, LOOP_MASK_KIND, MASK_SAME_ROWS, MASK_SAME_COLS, DOT_PRECISION,
                )  # fmt: skip

    dk_base = DK + off_b * stride_dkb + off_hk * stride_dkh + k_start * stride_dkn
    dv_base = DV_OUT + off_b * stride_dvb + off_hk * stride_dvh + k_start * stride_dvn
    dk_ty = DK.dtype.element_ty
    dv_ty = DV_OUT.dtype.element_ty
    store_split(dk_base, (dk * scale).to(dk_ty), (dk2 * scale).to(dk_ty), offs_n, stride_dkn,
                stride_dkd, Lk, D, HEAD_DIM, HEAD_DIM_TAIL)  # fmt: skip
    store_split(dv_base, dv.to(dv_ty), dv2.to(dv_ty), offs_n, stride_dvn, stride_dvd, Lk, DV,
                HEAD_DIM_V, HEAD_DIM_V_TAIL)  # fmt: skip


@triton.jit
def _add_mask_grad(
    dmask_base,
    ds,
    offs_m,
    offs_n,
    stride_gm,
    stride_gn,
    Lq,
    Lk,
    SAME_ROWS: tl.constexpr,
    SAME_COLS: tl.constexpr,
):
    """dmask += ds over this tile; rows/columns the mask broadcasts are summed first."""
    in_m = offs_m < Lq
    in_n = offs_n < Lk
    if SAME_ROWS:
        tl.atomic_add(dmask_base + offs_n * stride_gn, tl.sum(ds, 0), mask=in_n)
    elif SAME_COLS:
        tl.atomic_add(dmask_base + offs_m * stride_gm, tl.sum(ds, 1), mask=in_m)
    else:
        ptrs = dmask_base + offs_m[:, None] * stride_gm + offs_n[None, :] * stride_gn
        tl.atomic_add(ptrs, ds, mask=in_m[:, None] & in_n[None, :])


@triton.jit
def _attn_bwd_dq_inner(
    dq,
    dq2,
    q,
    q2,
    do,
    do2,
    lse,
    delta,
    offs_m,
    k_base,
    v_base,
    mask_base,
    dmask_base,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    stride_mm,
    stride_mn,
    stride_gm,
    stride_gn,
    lo,
    hi,
    Lq,
    Lk,
    causal_offset,
    qk_scale,
    mask_min,
    D: tl.constexpr,
    DV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_TAIL: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_TAIL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    MASK_KIND: tl.constexpr,
    MASK_SAME_ROWS: tl.constexpr,
    MASK_SAME_COLS: tl.constexpr,
    MASK_GRAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, k2 = load_split(k_base, offs_n, stride_kn, stride_kd, Lk, D, HEAD_DIM, HEAD_DIM_TAIL,
                           MASK)  # fmt: skip
        v, v2 = load_split(v_base, offs_n, stride_vn, stride_vd, Lk, DV, HEAD_DIM_V,
                           HEAD_DIM_V_TAIL, MASK)  # fmt: skip
        qk = dot_split(q, q2, k, k2, None, HEAD_DIM_TAIL, DOT_PRECISION) * qk_scale
        if MASK:
            keep = score_mask(offs_m, offs_n, Lk, causal_offset, IS_CAUSAL)
            qk = tl.where(keep, qk, float("-inf"))
        if MASK_KIND != 0:
            vals = load_mask(mask_base, offs_m, offs_n, stride_mm, stride_mn, Lq, Lk,
                             MASK_SAME_ROWS, MASK_SAME_COLS)  # fmt: skip
            qk = apply_mask(qk, vals, mask_min, MASK_KIND)
        p = tl.math.exp2(qk - lse[:, None])
        dp = dot_split(do, do2, v, v2, None, HEAD_DIM_V_TAIL, DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if MASK_GRAD:  # d loss / d (additive mask) = dS
            _add_mask_grad(dmask_base, ds, offs_m, offs_n, stride_gm, stride_gn, Lq, Lk,
                           MASK_SAME_ROWS, MASK_SAME_COLS)  # fmt: skip
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        if HEAD_DIM_TAIL > 0:
            dq2 = tl.dot(ds.to(k.dtype), k2, dq2, input_precision=DOT_PRECISION)
    return dq, dq2


@triton.jit
def attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    MASK,
    DMASK,
    KV_RANGES,
    CU_SEQLENS_Q,
    CU_SEQLENS_K,
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
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    stride_gb,
    stride_gh,
    stride_gm,
    stride_gn,
    stride_rb,
    stride_rh,
    stride_rg,
    stride_lb,
    stride_lh,
    scale,
    mask_min,
    causal_offset,
    H,
    GROUP,
    Lq,
    Lk,
    D: tl.constexpr,
    DV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_TAIL: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    MASK_KIND: tl.constexpr,
    MASK_SAME_ROWS: tl.constexpr,
    MASK_SAME_COLS: tl.constexpr,
    MASK_GRAD: tl.constexpr,
    MASK_SPLIT: tl.constexpr,
    VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr,
):
    """dq (and the additive mask's gradient) for one [BLOCK_M] query block.

    Grid: (cdiv(Lq, BLOCK_M), B * H). DMASK: float32, zeroed, broadcast like MASK (stride_g*).
    """
    stride_qm, stride_dom = aligned(stride_qm, STRIDE_ALIGN), aligned(stride_dom, STRIDE_ALIGN)
    stride_kn, stride_vn = aligned(stride_kn, STRIDE_ALIGN), aligned(stride_vn, STRIDE_ALIGN)
    stride_dqm = aligned(stride_dqm, STRIDE_ALIGN)
    LOOP_MASK_KIND: tl.constexpr = 0 if MASK_SPLIT == 1 else MASK_KIND  # see fwd.py
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    off_hk = off_h // GROUP
    q_start, Lq, k_start, Lk = seq_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, off_b, Lq, Lk, VARLEN)
    if start_m >= Lq:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)

    q, q2 = load_split(Q + off_b * stride_qb + off_h * stride_qh + q_start * stride_qm, offs_m,
                       stride_qm, stride_qd, Lq, D, HEAD_DIM, HEAD_DIM_TAIL, True)  # fmt: skip
    do, do2 = load_split(DO + off_b * stride_dob + off_h * stride_doh + q_start * stride_dom,
                         offs_m, stride_dom, stride_dod, Lq, DV, HEAD_DIM_V, HEAD_DIM_V_TAIL,
                         True)  # fmt: skip
    row_base = off_b * stride_lb + off_h * stride_lh + q_start
    lse, delta = _load_row_stats(LSE, DELTA, row_base, offs_m, Lq)
    k_base = K + off_b * stride_kb + off_hk * stride_kh + k_start * stride_kn
    v_base = V + off_b * stride_vb + off_hk * stride_vh + k_start * stride_vn
    mask_base = MASK + off_b * stride_mb + off_h * stride_mh
    dmask_base = DMASK + off_b * stride_gb + off_h * stride_gh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    dq2 = dq  # the tail columns' (unused without HEAD_DIM_TAIL)
    if HEAD_DIM_TAIL > 0:
        dq2 = tl.zeros([BLOCK_M, HEAD_DIM_TAIL], dtype=tl.float32)
    qk_scale = scale * LOG2E

    lo, hi, k_bound, run = block_range(
        KV_RANGES, stride_rb, stride_rh, stride_rg, off_b, off_h, start_m, Lq, Lk,
        BLOCK_M, BLOCK_N, MASK_KIND, MASK_SPLIT,
    )  # fmt: skip
    if run == 0:
        return
    full_end, end = key_range(start_m, k_bound, causal_offset, BLOCK_M, BLOCK_N, IS_CAUSAL)
    for stage in tl.static_range(2):  # unmasked key blocks first
        s_lo = lo if stage == 0 else tl.maximum(lo, full_end)
        s_hi = tl.minimum(full_end, hi) if stage == 0 else tl.minimum(end, hi)
        dq, dq2 = _attn_bwd_dq_inner(
            dq, dq2, q, q2, do, do2, lse, delta, offs_m, k_base, v_base, mask_base, dmask_base,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn, stride_gm, stride_gn,
            s_lo, s_hi, Lq, k_bound, causal_offset, qk_scale, mask_min,
            D, DV, HEAD_DIM, HEAD_DIM_TAIL, HEAD_DIM_V, HEAD_DIM_V_TAIL, BLOCK_N, stage == 1,
            IS_CAUSAL, LOOP_MASK_KIND, MASK_SAME_ROWS, MASK_SAME_COLS, MASK_GRAD, DOT_PRECISION,
        )  # fmt: skip

    dq_ty = DQ.dtype.element_ty
    store_split(DQ + off_b * stride_dqb + off_h * stride_dqh + q_start * stride_dqm,
                (dq * scale).to(dq_ty), (dq2 * scale).to(dq_ty), offs_m, stride_dqm, stride_dqd,
                Lq, D, HEAD_DIM, HEAD_DIM_TAIL)  # fmt: skip
