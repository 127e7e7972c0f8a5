"""Attention backward: FlashAttention-2 style (Dao, 2023, Alg. 2), two kernels, optionally
through the forward-mode tangent as well (reverse mode through o_t, and double backward).

With P = exp(scale * q k^T - lse) rebuilt from the saved log-sum-exp:

    dV = P^T dO,   dP = dO V^T,   delta = rowsum(dO o O),
    dS = P o (dP - delta),   dQ = scale * dS K,   dK = scale * dS^T Q.

With a tangent (TANGENT): the cotangent G = dO_t of o_t = P_t V + P V_t (and/or one of mu,
lse's tangent) enters too, where S_t = scale (Q_t K^T + Q K_t^T) [+ mask_t], mu =
rowsum(P o S_t) (saved by the forward) and P_t = P o (S_t - mu). The preprocess gives

    delta = rowsum(dO o O) + rowsum(G o O_t) [- dlse],   gamma = rowsum(G o O) [- dmu],

and per tile

    dS_t = P o (G V^T - gamma),
    dS   = P o (dO V^T + G V_t^T - delta) + dS_t o (S_t - mu),
    dQ  += scale (dS K + dS_t K_t),     dQ_t += scale dS_t K,
    dK  += scale (dS^T Q + dS_t^T Q_t), dK_t += scale dS_t^T Q,
    dV  += P^T dO + P_t^T G,            dV_t += P^T G,

(reference.attention_tangent_bwd has the derivation; checked against float64 autograd).
dK_t and dV_t are the primal backward's dK and dV with dO := G and delta := gamma, so _ops
runs the primal dK/dV kernel for them; dQ_t (dS_t K) and the mask tangent's gradient (dS_t)
come from the TANGENT dQ kernel, which has dS_t already (one more GEMM per tile; the primal
dQ kernel would recompute P and G V^T for them, three). Fused, the dK/dV kernel held four
accumulators and four key-side tiles (k, v, k_t, v_t) and ran at a fifth of the primal's
efficiency on the H200 (benchmarks/NOTES.md); split, it does 10 GEMMs per tile, the dQ
kernel 9 and the primal dK/dV kernel 4 more. Summing dQ with atomic adds in the dK/dV
kernels instead of a dQ kernel measured slower there (NOTES, 2026-12-04). Every per-row
statistic is O(L) (mu stored by the forward: recomputing it would need another pass over
the keys, 3 GEMMs per tile). Missing tangents and cotangents are compile-time switches, so
the primal backward compiles exactly as without them.

`attn_bwd_dkdv_kernel` owns one key block and walks the query blocks of every query head of
its group (so GQA sums dK/dV over the group without atomics); `attn_bwd_dq_kernel` owns one
query block and walks the key blocks. dq, dk, dv and their tangents' gradients are
deterministic (no atomics).

Out-of-range query rows read lse = +inf (so P = 0) and dO = 0; fully masked rows (lse = -inf)
are mapped to +inf the same way, so they contribute nothing. An attn_mask is applied as in the
forward, with the same block skipping; the gradient of an additive mask is dS itself (that of
its tangent dS_t), summed over the mask's broadcast dims with fp32 atomic adds by the dq
kernel. Packed batches (VARLEN) as in the forward.
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
    load_rows,
    load_split,
    load_tile,
    mask_range,
    score_mask,
    seq_bounds,
    store_split,
    tile_desc,
)


@triton.jit
def attn_bwd_preprocess_kernel(
    O,
    DO,
    DELTA,
    O_T,
    DO_T,
    GAMMA,
    CU_SEQLENS_Q,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    stride_otb,
    stride_oth,
    stride_otm,
    stride_otd,
    stride_dtb,
    stride_dth,
    stride_dtm,
    stride_dtd,
    stride_lb,
    stride_lh,
    H,
    Lq,
    DV: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    VARLEN: tl.constexpr,
    HAS_DO: tl.constexpr,
    HAS_DO_T: tl.constexpr,
    HAS_O_T: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr,
):
    """delta = rowsum(o * do) [+ rowsum(o_t * do_t)] and, with HAS_DO_T, gamma =
    rowsum(o * do_t), in float32, laid out like lse. Grid: (cdiv(Lq, BLOCK_M), B * H)."""
    stride_om, stride_dom = aligned(stride_om, STRIDE_ALIGN), aligned(stride_dom, STRIDE_ALIGN)
    stride_otm, stride_dtm = aligned(stride_otm, STRIDE_ALIGN), aligned(stride_dtm, STRIDE_ALIGN)
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
                  stride_om, stride_od, Lq, DV, True, pad).to(tl.float32)  # fmt: skip
    delta = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_DO:
        do = load_tile(DO + off_b * stride_dob + off_h * stride_doh + q_start * stride_dom, offs_m,
                       offs_dv, stride_dom, stride_dod, Lq, DV, True, pad)  # fmt: skip
        delta = tl.sum(o * do.to(tl.float32), 1)
    row_base = off_b * stride_lb + off_h * stride_lh + q_start
    if HAS_DO_T:
        g = load_tile(DO_T + off_b * stride_dtb + off_h * stride_dth + q_start * stride_dtm,
                      offs_m, offs_dv, stride_dtm, stride_dtd, Lq, DV, True, pad)  # fmt: skip
        g = g.to(tl.float32)
        tl.store(GAMMA + row_base + offs_m, tl.sum(o * g, 1), mask=offs_m < Lq)
        if HAS_O_T:
            o_t = load_tile(O_T + off_b * stride_otb + off_h * stride_oth + q_start * stride_otm,
                            offs_m, offs_dv, stride_otm, stride_otd, Lq, DV, True, pad)  # fmt: skip
            delta += tl.sum(o_t.to(tl.float32) * g, 1)
    tl.store(DELTA + row_base + offs_m, delta, mask=offs_m < Lq)


@triton.jit
def _load_row_stats(LSE, DELTA, row_base, offs_m, Lq):
    """lse (base 2, +inf for rows that must give P = 0) and delta for query rows offs_m."""
    lse = tl.load(LSE + row_base + offs_m, mask=offs_m < Lq, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    delta = tl.load(DELTA + row_base + offs_m, mask=offs_m < Lq, other=0.0)
    return lse, delta


@triton.jit
def _load_tangent_stats(GAMMA, MU, row_base, offs_m, Lq, TANGENT: tl.constexpr):
    """gamma and mu for query rows offs_m (0 outside; unused zeros without TANGENT)."""
    if TANGENT:
        gamma = tl.load(GAMMA + row_base + offs_m, mask=offs_m < Lq, other=0.0)
        mu = tl.load(MU + row_base + offs_m, mask=offs_m < Lq, other=0.0)
    else:
        gamma = tl.zeros([offs_m.shape[0]], dtype=tl.float32)
        mu = gamma
    return gamma, mu


@triton.jit
def _tangent_scores(
    a,
    a2,
    a_t,
    a_t2,
    b,
    b2,
    b_t,
    b_t2,
    mask_t,
    scale,
    TAIL: tl.constexpr,
    HAS_A_T: tl.constexpr,
    HAS_B_T: tl.constexpr,
    HAS_MASK_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """S_t = scale (a_t b^T + a b_t^T) [+ mask_t] for row tiles a (a2: tail columns) and b:
    (query rows, keys) in the dQ kernel, transposed (keys, query rows) in the dK/dV one."""
    if HAS_A_T:
        s_t = dot_split(a_t, a_t2, b, b2, None, TAIL, DOT_PRECISION)
        if HAS_B_T:
            s_t = dot_split(a, a2, b_t, b_t2, s_t, TAIL, DOT_PRECISION)
        s_t = s_t * scale
    elif HAS_B_T:
        s_t = dot_split(a, a2, b_t, b_t2, None, TAIL, DOT_PRECISION) * scale
    else:
        s_t = tl.zeros([a.shape[0], b.shape[0]], dtype=tl.float32)
    if HAS_MASK_T:
        s_t += mask_t.to(tl.float32)
    return s_t


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
    k_t,
    k_t2,
    v_t,
    v_t2,
    offs_n,
    q_base,
    do_base,
    q_t_base,
    do_t_base,
    mask_base,
    mask_t_base,
    LSE,
    DELTA,
    GAMMA,
    MU,
    row_base,
    stride_qm,
    stride_qd,
    stride_dom,
    stride_dod,
    stride_qtm,
    stride_qtd,
    stride_dtm,
    stride_dtd,
    stride_mm,
    stride_mn,
    stride_mtm,
    stride_mtn,
    lo,
    hi,
    Lq,
    Lk,
    causal_offset,
    qk_scale,
    scale,
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
    HAS_DO: tl.constexpr,
    TANGENT: tl.constexpr,
    HAS_DO_T: tl.constexpr,
    HAS_Q_T: tl.constexpr,
    HAS_K_T: tl.constexpr,
    HAS_V_T: tl.constexpr,
    HAS_MASK_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Everything here is transposed ([BLOCK_N, BLOCK_M]: keys x query rows, names ending in
    # T), so P^T and dS^T are never transposed in registers.
    TANGENT_S: tl.constexpr = TANGENT and (HAS_Q_T or HAS_K_T or HAS_MASK_T)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q, q2 = load_split(q_base, offs_m, stride_qm, stride_qd, Lq, D, HEAD_DIM, HEAD_DIM_TAIL,
                           True)  # fmt: skip
        do, do2 = q, q2  # dO (unused without HAS_DO)
        if HAS_DO:
            do, do2 = load_split(do_base, offs_m, stride_dom, stride_dod, Lq, DV, HEAD_DIM_V,
                                 HEAD_DIM_V_TAIL, True)  # fmt: skip
        lse, delta = _load_row_stats(LSE, DELTA, row_base, offs_m, Lq)
        qkT = dot_split(k, k2, q, q2, None, HEAD_DIM_TAIL, DOT_PRECISION) * qk_scale
        if MASK:  # causal diagonal blocks only (key bounds never reach a stored row)
            qkT = tl.where(offs_m[None, :] + causal_offset >= offs_n[:, None], qkT, float("-inf"))
        if MASK_KIND != 0:  # the mask tile transposed: rows are keys, columns query rows
            vals = load_mask(mask_base, offs_n, offs_m, stride_mn, stride_mm, Lk, Lq,
                             MASK_SAME_COLS, MASK_SAME_ROWS)  # fmt: skip
            qkT = apply_mask(qkT, vals, mask_min, MASK_KIND)
        pT = tl.math.exp2(qkT - lse[None, :])
        if HAS_DO:
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            if HEAD_DIM_V_TAIL > 0:
                dv2 = tl.dot(pT.to(do.dtype), do2, dv2, input_precision=DOT_PRECISION)
            dpT = dot_split(v, v2, do, do2, None, HEAD_DIM_V_TAIL, DOT_PRECISION)
        else:
            dpT = tl.zeros_like(pT)
        if TANGENT:
            gamma, mu = _load_tangent_stats(GAMMA, MU, row_base, offs_m, Lq, TANGENT)
            q_t, q_t2 = q, q2
            if HAS_Q_T:
                q_t, q_t2 = load_split(q_t_base, offs_m, stride_qtm, stride_qtd, Lq, D, HEAD_DIM,
                                       HEAD_DIM_TAIL, True)  # fmt: skip
            mask_tT = qkT
            if HAS_MASK_T:
                mask_tT = load_mask(mask_t_base, offs_n, offs_m, stride_mtn, stride_mtm, Lk, Lq,
                                    False, False)  # fmt: skip
            # S_t - mu: the centred tangent scores (P_t = P o centred)
            centred = _tangent_scores(k, k2, k_t, k_t2, q, q2, q_t, q_t2, mask_tT, scale,
                                      HEAD_DIM_TAIL, HAS_K_T, HAS_Q_T, HAS_MASK_T,
                                      DOT_PRECISION) - mu[None, :]  # fmt: skip
            if HAS_DO_T:
                g, g2 = load_split(do_t_base, offs_m, stride_dtm, stride_dtd, Lq, DV, HEAD_DIM_V,
                                   HEAD_DIM_V_TAIL, True)  # fmt: skip
                if TANGENT_S:  # dV += P_t^T G
                    p_tT = (pT * centred).to(g.dtype)
                    dv = tl.dot(p_tT, g, dv, input_precision=DOT_PRECISION)
                    if HEAD_DIM_V_TAIL > 0:
                        dv2 = tl.dot(p_tT, g2, dv2, input_precision=DOT_PRECISION)
                if HAS_V_T:  # dP += G V_t^T
                    dpT = dot_split(v_t, v_t2, g, g2, dpT, HEAD_DIM_V_TAIL, DOT_PRECISION)
            dsT = pT * (dpT - delta[None, :])
            if TANGENT_S:
                if HAS_DO_T:
                    dp_tT = dot_split(v, v2, g, g2, None, HEAD_DIM_V_TAIL, DOT_PRECISION)
                    ds_tT = pT * (dp_tT - gamma[None, :])
                else:  # only mu's cotangent (gamma = -dmu)
                    ds_tT = pT * (-gamma[None, :])
                dsT += ds_tT * centred
                if HAS_Q_T:  # dK += dS_t^T Q_t
                    dk = tl.dot(ds_tT.to(q.dtype), q_t, dk, input_precision=DOT_PRECISION)
                    if HEAD_DIM_TAIL > 0:
                        dk2 = tl.dot(ds_tT.to(q.dtype), q_t2, dk2, input_precision=DOT_PRECISION)
        else:
            dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
        if HEAD_DIM_TAIL > 0:
            dk2 = tl.dot(dsT.to(q.dtype), q2, dk2, input_precision=DOT_PRECISION)
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
    Q_T,
    K_T,
    V_T,
    DO_T,
    MASK_T,
    GAMMA,
    MU,
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
    stride_qtb,
    stride_qth,
    stride_qtm,
    stride_qtd,
    stride_ktb,
    stride_kth,
    stride_ktn,
    stride_ktd,
    stride_vtb,
    stride_vth,
    stride_vtn,
    stride_vtd,
    stride_dtb,
    stride_dth,
    stride_dtm,
    stride_dtd,
    stride_mtb,
    stride_mth,
    stride_mtm,
    stride_mtn,
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
    HAS_DO: tl.constexpr,
    TANGENT: tl.constexpr,
    HAS_DO_T: tl.constexpr,
    HAS_Q_T: tl.constexpr,
    HAS_K_T: tl.constexpr,
    HAS_V_T: tl.constexpr,
    HAS_MASK_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr,
):
    """dk, dv for one [BLOCK_N] key block of one kv head. Grid: (cdiv(Lk, BLOCK_N), B * H_KV).

    TANGENT: the backward through the tangent too (module docstring); Q_T..MASK_T are the
    forward's tangents (HAS_*), DO_T the cotangent of o_t (HAS_DO_T), GAMMA and MU per-row
    statistics laid out like LSE. Without HAS_DO there is no cotangent of o (dO = 0).
    """
    stride_qm, stride_dom = aligned(stride_qm, STRIDE_ALIGN), aligned(stride_dom, STRIDE_ALIGN)
    stride_kn, stride_vn = aligned(stride_kn, STRIDE_ALIGN), aligned(stride_vn, STRIDE_ALIGN)
    stride_dkn, stride_dvn = aligned(stride_dkn, STRIDE_ALIGN), aligned(stride_dvn, STRIDE_ALIGN)
    stride_qtm, stride_dtm = aligned(stride_qtm, STRIDE_ALIGN), aligned(stride_dtm, STRIDE_ALIGN)
    stride_ktn, stride_vtn = aligned(stride_ktn, STRIDE_ALIGN), aligned(stride_vtn, STRIDE_ALIGN)
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
    k_t, k_t2, v_t, v_t2 = k, k2, v, v2  # the tangents' (unused where absent)
    if TANGENT and HAS_K_T:
        k_t, k_t2 = load_split(K_T + off_b * stride_ktb + off_hk * stride_kth
                               + k_start * stride_ktn, offs_n, stride_ktn, stride_ktd, Lk, D,
                               HEAD_DIM, HEAD_DIM_TAIL, True)  # fmt: skip
    if TANGENT and HAS_V_T and HAS_DO_T:
        v_t, v_t2 = load_split(V_T + off_b * stride_vtb + off_hk * stride_vth
                               + k_start * stride_vtn, offs_n, stride_vtn, stride_vtd, Lk, DV,
                               HEAD_DIM_V, HEAD_DIM_V_TAIL, True)  # fmt: skip
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
        q_t_base = Q_T + off_b * stride_qtb + off_h * stride_qth + q_start * stride_qtm
        do_t_base = DO_T + off_b * stride_dtb + off_h * stride_dth + q_start * stride_dtm
        mask_base = MASK + off_b * stride_mb + off_h * stride_mh
        mask_t_base = MASK_T + off_b * stride_mtb + off_h * stride_mth
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
                    dk, dk2, dv, dv2, k, k2, v, v2, k_t, k_t2, v_t, v_t2, offs_n, q_base, do_base,
                    q_t_base, do_t_base, mask_base, mask_t_base, LSE, DELTA, GAMMA, MU, row_base,
                    stride_qm, stride_qd, stride_dom, stride_dod, stride_qtm, stride_qtd,
                    stride_dtm, stride_dtd, stride_mm, stride_mn, stride_mtm, stride_mtn, s_lo,
                    s_hi, q_bound, Lk, causal_offset, qk_scale, scale, mask_min, D, DV, HEAD_DIM,
                    HEAD_DIM_TAIL, HEAD_DIM_V, HEAD_DIM_V_TAIL, BLOCK_M, stage == 0, LOOP_MASK_KIND,
                    MASK_SAME_ROWS, MASK_SAME_COLS, HAS_DO, TANGENT, HAS_DO_T, HAS_Q_T, HAS_K_T,
                    HAS_V_T, HAS_MASK_T, DOT_PRECISION,
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
    dq_t,
    dq_t2,
    q,
    q2,
    q_t,
    q_t2,
    do,
    do2,
    g,
    g2,
    lse,
    delta,
    gamma,
    mu,
    offs_m,
    k_desc,
    v_desc,
    k_t_desc,
    v_t_desc,
    k_base,
    v_base,
    k_t_base,
    v_t_base,
    mask_base,
    mask_t_base,
    dmask_base,
    dmask_t_base,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    stride_ktn,
    stride_ktd,
    stride_vtn,
    stride_vtd,
    stride_mm,
    stride_mn,
    stride_mtm,
    stride_mtn,
    stride_gm,
    stride_gn,
    stride_gtm,
    stride_gtn,
    lo,
    hi,
    Lq,
    Lk,
    causal_offset,
    qk_scale,
    scale,
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
    HAS_DO: tl.constexpr,
    TANGENT: tl.constexpr,
    HAS_DO_T: tl.constexpr,
    HAS_Q_T: tl.constexpr,
    HAS_K_T: tl.constexpr,
    HAS_V_T: tl.constexpr,
    HAS_MASK_T: tl.constexpr,
    GRAD_T: tl.constexpr,
    MASK_T_GRAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    TANGENT_S: tl.constexpr = TANGENT and (HAS_Q_T or HAS_K_T or HAS_MASK_T)
    # Key rows from Lk on read as 0 (masked blocks only): the descriptors describe keys
    # [0, Lk) only (see the caller), so only the pointer loads check rows.
    CHECK_R: tl.constexpr = MASK and not TMA
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, k2 = load_rows(k_desc, k_base, start_n, offs_n, stride_kn, stride_kd, Lk, D, HEAD_DIM,
                          HEAD_DIM_TAIL, CHECK_R, TMA)  # fmt: skip
        v, v2 = load_rows(v_desc, v_base, start_n, offs_n, stride_vn, stride_vd, Lk, DV,
                          HEAD_DIM_V, HEAD_DIM_V_TAIL, CHECK_R, TMA)  # fmt: skip
        qk = dot_split(q, q2, k, k2, None, HEAD_DIM_TAIL, DOT_PRECISION) * qk_scale
        if MASK:
            keep = score_mask(offs_m, offs_n, Lk, causal_offset, IS_CAUSAL)
            qk = tl.where(keep, qk, float("-inf"))
        if MASK_KIND != 0:
            vals = load_mask(mask_base, offs_m, offs_n, stride_mm, stride_mn, Lq, Lk,
                             MASK_SAME_ROWS, MASK_SAME_COLS)  # fmt: skip
            qk = apply_mask(qk, vals, mask_min, MASK_KIND)
        p = tl.math.exp2(qk - lse[:, None])
        if HAS_DO:
            dp = dot_split(do, do2, v, v2, None, HEAD_DIM_V_TAIL, DOT_PRECISION)
        else:
            dp = tl.zeros_like(p)
        k_t, k_t2 = k, k2
        if TANGENT:
            if HAS_K_T:
                k_t, k_t2 = load_rows(k_t_desc, k_t_base, start_n, offs_n, stride_ktn, stride_ktd,
                                      Lk, D, HEAD_DIM, HEAD_DIM_TAIL, CHECK_R, TMA)  # fmt: skip
            if HAS_DO_T and HAS_V_T:  # dP += G V_t^T
                v_t, v_t2 = load_rows(v_t_desc, v_t_base, start_n, offs_n, stride_vtn, stride_vtd,
                                      Lk, DV, HEAD_DIM_V, HEAD_DIM_V_TAIL, CHECK_R,
                                      TMA)  # fmt: skip
                dp = dot_split(g, g2, v_t, v_t2, dp, HEAD_DIM_V_TAIL, DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        ds_t = ds  # dS_t (unused without a tangent of the scores)
        if TANGENT_S:
            mask_t = qk
            if HAS_MASK_T:
                mask_t = load_mask(mask_t_base, offs_m, offs_n, stride_mtm, stride_mtn, Lq, Lk,
                                   False, False)  # fmt: skip
            s_t = _tangent_scores(q, q2, q_t, q_t2, k, k2, k_t, k_t2, mask_t, scale,
                                  HEAD_DIM_TAIL, HAS_Q_T, HAS_K_T, HAS_MASK_T,
                                  DOT_PRECISION)  # fmt: skip
            if HAS_DO_T:
                dp_t = dot_split(g, g2, v, v2, None, HEAD_DIM_V_TAIL, DOT_PRECISION)
                ds_t = p * (dp_t - gamma[:, None])
            else:  # only mu's cotangent (gamma = -dmu)
                ds_t = p * (-gamma[:, None])
            ds += ds_t * (s_t - mu[:, None])
            if MASK_T_GRAD:  # d loss / d (the additive mask's tangent) = dS_t
                _add_mask_grad(dmask_t_base, ds_t, offs_m, offs_n, stride_gtm, stride_gtn, Lq,
                               Lk, MASK_SAME_ROWS, MASK_SAME_COLS)  # fmt: skip
            if HAS_K_T:  # dQ += dS_t K_t
                dq = tl.dot(ds_t.to(k.dtype), k_t, dq, input_precision=DOT_PRECISION)
                if HEAD_DIM_TAIL > 0:
                    dq2 = tl.dot(ds_t.to(k.dtype), k_t2, dq2, input_precision=DOT_PRECISION)
            if HAS_Q_T and GRAD_T:  # dQ_t += dS_t K
                dq_t = tl.dot(ds_t.to(k.dtype), k, dq_t, input_precision=DOT_PRECISION)
                if HEAD_DIM_TAIL > 0:
                    dq_t2 = tl.dot(ds_t.to(k.dtype), k2, dq_t2, input_precision=DOT_PRECISION)
        if MASK_GRAD:  # d loss / d (additive mask) = dS
            _add_mask_grad(dmask_base, ds, offs_m, offs_n, stride_gm, stride_gn, Lq, Lk,
                           MASK_SAME_ROWS, MASK_SAME_COLS)  # fmt: skip
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        if HEAD_DIM_TAIL > 0:
            dq2 = tl.dot(ds.to(k.dtype), k2, dq2, input_precision=DOT_PRECISION)
    return dq, dq2, dq_t, dq_t2


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
    DQ_T,
    DMASK_T,
    CU_SEQLENS_Q,
    CU_SEQLENS_K,
    Q_T,
    K_T,
    V_T,
    DO_T,
    MASK_T,
    GAMMA,
    MU,
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
    stride_dqtb,
    stride_dqth,
    stride_dqtm,
    stride_dqtd,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    stride_gb,
    stride_gh,
    stride_gm,
    stride_gn,
    stride_gtb,
    stride_gth,
    stride_gtm,
    stride_gtn,
    stride_rb,
    stride_rh,
    stride_rg,
    stride_lb,
    stride_lh,
    stride_qtb,
    stride_qth,
    stride_qtm,
    stride_qtd,
    stride_ktb,
    stride_kth,
    stride_ktn,
    stride_ktd,
    stride_vtb,
    stride_vth,
    stride_vtn,
    stride_vtd,
    stride_dtb,
    stride_dth,
    stride_dtm,
    stride_dtd,
    stride_mtb,
    stride_mth,
    stride_mtm,
    stride_mtn,
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
    HAS_DO: tl.constexpr,
    TANGENT: tl.constexpr,
    HAS_DO_T: tl.constexpr,
    HAS_Q_T: tl.constexpr,
    HAS_K_T: tl.constexpr,
    HAS_V_T: tl.constexpr,
    HAS_MASK_T: tl.constexpr,
    GRAD_T: tl.constexpr,
    MASK_T_GRAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr,
    TMA: tl.constexpr,
):
    """dq (and with MASK_GRAD the additive mask's gradient) for one [BLOCK_M] query block.

    Grid: (cdiv(Lq, BLOCK_M), B * H). DMASK: float32, zeroed, broadcast like MASK
    (stride_g*). Tangent arguments as in attn_bwd_dkdv_kernel. With TANGENT, also DQ_T =
    dq_t (GRAD_T, where HAS_Q_T; strides stride_dqt*) and DMASK_T, the mask tangent's
    gradient (MASK_T_GRAD; like DMASK, strides stride_gt*): one more GEMM per tile, where
    the primal kernel with dO := dO_t would recompute P and dO_t V^T for them.
    TMA: the key loop's tiles (k, v, k_t, v_t) come through tensor descriptors made here
    (common.tile_desc), one per query head (and packed sequence), instead of pointer loads,
    which hold address registers per element: single head-dim tiles, those tensors and their
    strides 16-byte aligned with unit column stride (the launcher checks).
    """
    stride_qm, stride_dom = aligned(stride_qm, STRIDE_ALIGN), aligned(stride_dom, STRIDE_ALIGN)
    stride_kn, stride_vn = aligned(stride_kn, STRIDE_ALIGN), aligned(stride_vn, STRIDE_ALIGN)
    stride_dqm, stride_dqtm = aligned(stride_dqm, STRIDE_ALIGN), aligned(stride_dqtm, STRIDE_ALIGN)
    stride_qtm, stride_dtm = aligned(stride_qtm, STRIDE_ALIGN), aligned(stride_dtm, STRIDE_ALIGN)
    stride_ktn, stride_vtn = aligned(stride_ktn, STRIDE_ALIGN), aligned(stride_vtn, STRIDE_ALIGN)
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
    do, do2 = q, q  # dO (unused without HAS_DO)
    if HAS_DO:
        do, do2 = load_split(DO + off_b * stride_dob + off_h * stride_doh + q_start * stride_dom,
                             offs_m, stride_dom, stride_dod, Lq, DV, HEAD_DIM_V, HEAD_DIM_V_TAIL,
                             True)  # fmt: skip
    q_t, q_t2, g, g2 = q, q2, do, do2  # the tangent's and dO_t (unused where absent)
    if TANGENT and HAS_Q_T:
        q_t, q_t2 = load_split(Q_T + off_b * stride_qtb + off_h * stride_qth
                               + q_start * stride_qtm, offs_m, stride_qtm, stride_qtd, Lq, D,
                               HEAD_DIM, HEAD_DIM_TAIL, True)  # fmt: skip
    if TANGENT and HAS_DO_T:
        g, g2 = load_split(DO_T + off_b * stride_dtb + off_h * stride_dth + q_start * stride_dtm,
                           offs_m, stride_dtm, stride_dtd, Lq, DV, HEAD_DIM_V, HEAD_DIM_V_TAIL,
                           True)  # fmt: skip
    row_base = off_b * stride_lb + off_h * stride_lh + q_start
    lse, delta = _load_row_stats(LSE, DELTA, row_base, offs_m, Lq)
    gamma, mu = _load_tangent_stats(GAMMA, MU, row_base, offs_m, Lq, TANGENT)
    k_base = K + off_b * stride_kb + off_hk * stride_kh + k_start * stride_kn
    v_base = V + off_b * stride_vb + off_hk * stride_vh + k_start * stride_vn
    k_t_base = K_T + off_b * stride_ktb + off_hk * stride_kth + k_start * stride_ktn
    v_t_base = V_T + off_b * stride_vtb + off_hk * stride_vth + k_start * stride_vtn
    mask_base = MASK + off_b * stride_mb + off_h * stride_mh
    mask_t_base = MASK_T + off_b * stride_mtb + off_h * stride_mth
    dmask_base = DMASK + off_b * stride_gb + off_h * stride_gh
    dmask_t_base = DMASK_T + off_b * stride_gtb + off_h * stride_gth
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    dq2 = dq  # the tail columns' (unused without HEAD_DIM_TAIL)
    if HEAD_DIM_TAIL > 0:
        dq2 = tl.zeros([BLOCK_M, HEAD_DIM_TAIL], dtype=tl.float32)
    dq_t, dq_t2 = dq, dq2  # q_t's gradient (unused without it)
    if TANGENT and GRAD_T and HAS_Q_T:
        dq_t = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        if HEAD_DIM_TAIL > 0:
            dq_t2 = tl.zeros([BLOCK_M, HEAD_DIM_TAIL], dtype=tl.float32)
    qk_scale = scale * LOG2E

    lo, hi, k_bound, run = block_range(
        KV_RANGES, stride_rb, stride_rh, stride_rg, off_b, off_h, start_m, Lq, Lk,
        BLOCK_M, BLOCK_N, MASK_KIND, MASK_SPLIT,
    )  # fmt: skip
    if run == 0:
        return
    # Descriptors of keys [0, k_bound) (a mask's key range ends there, else the keys do): the
    # copy engine zero-fills the rest, as the pointer loads' row check does. Absent tensors'
    # descriptors: the primal's, never read.
    k_desc, v_desc, k_t_desc, v_t_desc = k_base, v_base, k_t_base, v_t_base
    if TMA:
        k_desc = tile_desc(k_base, k_bound, stride_kn, D, BLOCK_N, HEAD_DIM)
        v_desc = tile_desc(v_base, k_bound, stride_vn, DV, BLOCK_N, HEAD_DIM_V)
        k_t_desc, v_t_desc = k_desc, v_desc
        if TANGENT and HAS_K_T:
            k_t_desc = tile_desc(k_t_base, k_bound, stride_ktn, D, BLOCK_N, HEAD_DIM)
        if TANGENT and HAS_DO_T and HAS_V_T:
            v_t_desc = tile_desc(v_t_base, k_bound, stride_vtn, DV, BLOCK_N, HEAD_DIM_V)
    full_end, end = key_range(start_m, k_bound, causal_offset, BLOCK_M, BLOCK_N, IS_CAUSAL)
    for stage in tl.static_range(2):  # unmasked key blocks first
        s_lo = lo if stage == 0 else tl.maximum(lo, full_end)
        s_hi = tl.minimum(full_end, hi) if stage == 0 else tl.minimum(end, hi)
        dq, dq2, dq_t, dq_t2 = _attn_bwd_dq_inner(
            dq, dq2, dq_t, dq_t2, q, q2, q_t, q_t2, do, do2, g, g2, lse, delta, gamma, mu,
            offs_m, k_desc, v_desc, k_t_desc, v_t_desc, k_base, v_base, k_t_base, v_t_base,
            mask_base, mask_t_base, dmask_base,
            dmask_t_base, stride_kn, stride_kd, stride_vn, stride_vd, stride_ktn, stride_ktd,
            stride_vtn, stride_vtd, stride_mm, stride_mn, stride_mtm, stride_mtn, stride_gm,
            stride_gn, stride_gtm, stride_gtn, s_lo, s_hi, Lq, k_bound, causal_offset, qk_scale,
            scale, mask_min, D, DV, HEAD_DIM, HEAD_DIM_TAIL, HEAD_DIM_V, HEAD_DIM_V_TAIL, BLOCK_N,
            stage == 1, IS_CAUSAL, LOOP_MASK_KIND, MASK_SAME_ROWS, MASK_SAME_COLS, MASK_GRAD,
            HAS_DO, TANGENT, HAS_DO_T, HAS_Q_T, HAS_K_T, HAS_V_T, HAS_MASK_T, GRAD_T,
            MASK_T_GRAD, DOT_PRECISION, TMA,
        )  # fmt: skip

    dq_ty = DQ.dtype.element_ty
    store_split(DQ + off_b * stride_dqb + off_h * stride_dqh + q_start * stride_dqm,
                (dq * scale).to(dq_ty), (dq2 * scale).to(dq_ty), offs_m, stride_dqm, stride_dqd,
                Lq, D, HEAD_DIM, HEAD_DIM_TAIL)  # fmt: skip
    if TANGENT and GRAD_T and HAS_Q_T:
        store_split(DQ_T + off_b * stride_dqtb + off_h * stride_dqth + q_start * stride_dqtm,
                    (dq_t * scale).to(dq_ty), (dq_t2 * scale).to(dq_ty), offs_m, stride_dqtm,
                    stride_dqtd, Lq, D, HEAD_DIM, HEAD_DIM_TAIL)  # fmt: skip
