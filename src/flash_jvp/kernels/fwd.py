"""Attention forward, with the forward-mode tangent (JVP) fused into the same pass.

FlashAttention-2 online softmax (Dao, 2023, Alg. 1) over key blocks, one program per
(query block, batch*head). The JVP of O = softmax(S) V along S_t = scale (Q_t K^T + Q K_t^T)
and V_t is

    O_t = P_t V + P V_t,   P_t = P o (S_t - mu),   mu = rowsum(P o S_t) / rowsum(P).

With a tangent present the kernel also carries, per query row (unnormalised, under the same
running max as P): g = rowsum(P o S_t), its running mean mu = g / l, and one accumulator

    acc_t = (P o (S_t - mu)) V + P V_t.

When a block moves mu, the part already summed is re-centred with the primal accumulator
(acc_t -= (mu_new - mu_old) * acc), so at the end O_t = acc_t / l exactly. Centring as we go
keeps the products small for peaked rows; the textbook split (P o S_t) V - mu * O cancels
catastrophically there in fp16/bf16.
Primal scores live in base 2 (scale * log2 e, so exp2 can be used); tangent scores use the
plain scale. Only the primal running max is kept: the tangent terms are linear in P.
Missing tangents are compile-time switches, so a primal-only call pays nothing for them.

An attn_mask (boolean or additive, read through its strides) is applied to the scores; an
additive mask's tangent adds to S_t. Key blocks outside the range the mask leaves visible
(see _ops.mask_ranges) are skipped. Rows whose every key is masked out get o = o_t = 0 and
lse = -inf. Packed variable-length batches (VARLEN) read each sequence's bounds from the
cumulative lengths; the grid then runs over the longest sequence.
"""

import triton
import triton.language as tl

from .common import (
    LN2,
    LOG2E,
    aligned,
    apply_mask,
    block_range,
    dot_split,
    key_range,
    load_mask,
    load_rows,
    load_split,
    score_mask,
    seq_bounds,
    store_split,
    tile_desc,
)


@triton.jit
def _attn_fwd_pv(
    acc,
    acc_t,
    p,
    p_s_t,
    alpha,
    d_mu,
    v,
    v_t,
    TANGENT_S: tl.constexpr,
    HAS_V_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key block's update of the accumulators of one value-column tile: rescale by
    alpha, re-centre acc_t by d_mu, add P_c V + P V_t and P V."""
    acc = acc * alpha[:, None]
    if TANGENT_S or HAS_V_T:
        acc_t = acc_t * alpha[:, None]
    if TANGENT_S:
        # Centre on the running mean mu (d_mu: how far this block moved it), re-centring
        # what is already summed, so the products stay small when softmax is peaked.
        acc_t -= d_mu[:, None] * acc
        acc_t = tl.dot(p_s_t.to(v.dtype), v, acc_t, input_precision=DOT_PRECISION)
    if HAS_V_T:
        acc_t = tl.dot(p.to(v_t.dtype), v_t, acc_t, input_precision=DOT_PRECISION)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, acc_t


@triton.jit
def _attn_fwd_inner(
    acc,
    acc2,
    acc_t,
    acc_t2,
    m_i,
    l_i,
    g_i,
    mu_i,
    q,
    q2,
    q_t,
    q_t2,
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
    HAS_Q_T: tl.constexpr,
    HAS_K_T: tl.constexpr,
    HAS_V_T: tl.constexpr,
    HAS_MASK_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    KEY_BOUND: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    TANGENT_S: tl.constexpr = HAS_Q_T or HAS_K_T or HAS_MASK_T  # the scores have a tangent
    # Rows past Lk to zero: the descriptor loads zero-fill past the tensor's end already, so
    # they need it only where a mask's key range (KEY_BOUND) ends the loop before that (the
    # extra select costs registers: spills in the fwd+JVP kernel at E=128).
    CHECK_R: tl.constexpr = MASK == 1 and (not TMA or KEY_BOUND)
    # WARP_SPECIALIZE: Triton splits the loop into a producer warp issuing the descriptor
    # loads and consumer warps doing the products and softmax (sm_90; descriptors only)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, k2 = load_rows(k_desc, k_base, start_n, offs_n, stride_kn, stride_kd,
                          Lk, D, HEAD_DIM, HEAD_DIM_TAIL, CHECK_R, TMA)  # fmt: skip
        qk = dot_split(q, q2, k, k2, None, HEAD_DIM_TAIL, DOT_PRECISION)
        if MASK == 2 and not IS_CAUSAL:  # keys past Lk as a bias in the scaling's FMA
            qk = qk * qk_scale + tl.where(offs_n < Lk, 0.0, float("-inf"))[None, :]
        else:
            qk = qk * qk_scale
        if MASK == 1:
            keep = score_mask(offs_m, offs_n, Lk, causal_offset, IS_CAUSAL)
            qk = tl.where(keep, qk, float("-inf"))
        elif MASK == 2 and IS_CAUSAL:
            # Row i of the block keeps key j < Lk if i >= j - start_m - causal_offset. Built
            # from in-loop vectors and a bare arange only: a computed register tensor from
            # before the loop (offs_m) read wrong inside the warp-specialised loop (causal o,
            # o_t off by 0.2-0.6 on the H100), and rebuilding it inside is hoisted back out.
            first = _row_block(IS_CAUSAL) * offs_m.shape[0] + causal_offset
            shift = tl.where(offs_n < Lk, offs_n - first, offs_m.shape[0])
            keep = tl.arange(0, offs_m.shape[0])[:, None] >= shift[None, :]
            qk = tl.where(keep, qk, float("-inf"))
        if MASK_KIND != 0:
            vals = load_mask(mask_base, offs_m, offs_n, stride_mm, stride_mn, Lq, Lk,
                             MASK_SAME_ROWS, MASK_SAME_COLS)  # fmt: skip
            qk = apply_mask(qk, vals, mask_min, MASK_KIND)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row with no visible key so far keeps m = -inf; use 0 so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v, v2 = load_rows(v_desc, v_base, start_n, offs_n, stride_vn, stride_vd,
                          Lk, DV, HEAD_DIM_V, HEAD_DIM_V_TAIL, CHECK_R, TMA)  # fmt: skip
        # V_t is loaded here, beside V, not next to its product: loaded there, its tail tile
        # (head dims such as 72: 8 of 16 columns) came out wrong, nondeterministic or as an
        # illegal shared-memory read on sm_90 with Triton 3.6 (benchmarks/NOTES.md)
        v_t, v_t2 = v, v2
        if HAS_V_T:
            v_t, v_t2 = load_rows(v_t_desc, v_t_base, start_n, offs_n,
                                  stride_vtn, stride_vtd, Lk, DV, HEAD_DIM_V, HEAD_DIM_V_TAIL,
                                  CHECK_R, TMA)  # fmt: skip
        p_s_t = p  # P o (S_t - mu) and the move of mu, with a tangent of the scores
        d_mu = alpha
        if TANGENT_S:
            if HAS_K_T:
                k_t, k_t2 = load_rows(k_t_desc, k_t_base, start_n, offs_n,
                                      stride_ktn, stride_ktd, Lk, D, HEAD_DIM, HEAD_DIM_TAIL,
                                      CHECK_R, TMA)  # fmt: skip
            if HAS_Q_T:
                s_t = dot_split(q_t, q_t2, k, k2, None, HEAD_DIM_TAIL, DOT_PRECISION)
                if HAS_K_T:
                    s_t = dot_split(q, q2, k_t, k_t2, s_t, HEAD_DIM_TAIL, DOT_PRECISION)
            elif HAS_K_T:
                s_t = dot_split(q, q2, k_t, k_t2, None, HEAD_DIM_TAIL, DOT_PRECISION)
            else:
                s_t = tl.zeros_like(qk)
            # s_t is unscaled; t_scale enters through one FMA below and a per-row factor of g
            # (measured: 2-3 % of the fused pass against scaling every score)
            t_scale = scale
            if HAS_MASK_T:  # the additive mask's own tangent
                t_scale = 1.0
                mask_t = load_mask(mask_t_base, offs_m, offs_n, stride_mtm, stride_mtn, Lq, Lk,
                                   False, False)  # fmt: skip
                s_t = s_t * scale + mask_t.to(tl.float32)
            g_i = g_i * alpha + tl.sum(p * s_t, 1) * t_scale  # masked keys have p = 0
            mu_new = g_i / tl.where(l_i == 0.0, 1.0, l_i)  # the running mean of S_t
            p_s_t = p * (s_t * t_scale - mu_new[:, None])
            d_mu = mu_new - mu_i
            mu_i = mu_new
        acc, acc_t = _attn_fwd_pv(acc, acc_t, p, p_s_t, alpha, d_mu, v, v_t, TANGENT_S, HAS_V_T,
                                  DOT_PRECISION)  # fmt: skip
        if HEAD_DIM_V_TAIL > 0:  # never with TMA (single tiles only)
            acc2, acc_t2 = _attn_fwd_pv(acc2, acc_t2, p, p_s_t, alpha, d_mu, v2, v_t2, TANGENT_S,
                                        HAS_V_T, DOT_PRECISION)  # fmt: skip
        m_i = m_new
    return acc, acc2, acc_t, acc_t2, m_i, l_i, g_i, mu_i


@triton.jit
def _row_block(LONGEST_FIRST: tl.constexpr):
    """This program's query block. LONGEST_FIRST (causal: block m sees m + 1 key blocks)
    takes them in reverse, so the programs the GPU starts last are the shortest and the
    grid's last wave ends sooner (blocks start in program_id order, axis 0 fastest)."""
    if LONGEST_FIRST:
        return tl.num_programs(0) - 1 - tl.program_id(0)
    return tl.program_id(0)


@triton.jit
def _store_o(base, a, a2, start_m, offs_m, stride_m, stride_d, Lq, DV: tl.constexpr,
             BLOCK_M: tl.constexpr, HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_TAIL: tl.constexpr,
             TMA: tl.constexpr):  # fmt: skip
    """Store an output block (two column tiles, see common.store_split); with TMA through a
    descriptor (pointer stores after a warp-specialised loop faulted on sm_90)."""
    if TMA:
        tile_desc(base, Lq, stride_m, DV, BLOCK_M, HEAD_DIM_V).store([start_m, 0], a)
    else:
        store_split(base, a, a2, offs_m, stride_m, stride_d, Lq, DV, HEAD_DIM_V, HEAD_DIM_V_TAIL)


@triton.jit
def _store_rows(base, x, start_m, offs_m, Lq, BLOCK_M: tl.constexpr, DESC: tl.constexpr):
    """Store a per-row vector (lse, mu) of rows offs_m = start_m + arange; with DESC through a
    1-D descriptor (its base 16-byte aligned: the launcher checks): after a warp-specialised
    loop, pointer stores wrote nothing (mu) or faulted on sm_90 (benchmarks/NOTES.md)."""
    if DESC:
        tl.make_tensor_descriptor(base, [Lq], [1], [BLOCK_M]).store([start_m], x)
    else:
        tl.store(base + offs_m, x, mask=offs_m < Lq)


@triton.jit
def attn_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    Q_T,
    K_T,
    V_T,
    O_T,
    MU,
    MASK,
    MASK_T,
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
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
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
    stride_otb,
    stride_oth,
    stride_otm,
    stride_otd,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    stride_mtb,
    stride_mth,
    stride_mtm,
    stride_mtn,
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
    MASK_SPLIT: tl.constexpr,
    VARLEN: tl.constexpr,
    HAS_Q_T: tl.constexpr,
    HAS_K_T: tl.constexpr,
    HAS_V_T: tl.constexpr,
    HAS_MASK_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr,
    TMA: tl.constexpr,
    WS: tl.constexpr,
):
    """o = softmax(scale * q k^T [+ mask]) v and lse for one [BLOCK_M] query block; with
    tangents also o_t and mu = rowsum(P o S_t), the tangent of lse.

    Grid: (cdiv(Lq, BLOCK_M), B * H). q/o: (B, H, Lq, D|DV), k/v: (B, H // GROUP, Lk, D|DV),
    tangents shaped like their primals, mask and its tangent broadcast to (B, H, Lq, Lk)
    through strides, lse: float32 natural log at LSE + b * stride_lb + h * stride_lh + row,
    mu laid out alike at MU.
    VARLEN: batch entry b is the packed sequence b (stride_*b = 0; Lq, Lk the longest).
    MASK_SPLIT (boolean masks): the launcher runs the kernel twice; launch 1 takes the query
    blocks whose every row sees exactly keys [lo, hi) (no mask loads: keys are bounded by hi),
    launch 2 the others; a program not of its launch's kind exits at once.
    The D (DV) columns are tiled as HEAD_DIM (HEAD_DIM_V) columns, powers of two >= 16,
    plus, when HEAD_DIM_TAIL (HEAD_DIM_V_TAIL) > 0, that many more (see common.load_split);
    padding reads as zero. STRIDE_ALIGN divides every row stride (see common.aligned).
    TMA: q, k, v and their tangents are read, o and o_t written, through tensor descriptors
    made here (common.tile_desc) instead of pointers: single head-dim tiles, every tensor
    and stride 16-byte aligned with unit column stride (the launcher checks).
    WS: one warp-specialised key loop over every key block, each masked (with TMA, no
    attn_mask, dense); lse and mu stored through descriptors too; the launcher provides
    the descriptors' global scratch and compiles it through ws_barriers.compile_hook.
    """
    stride_qm, stride_qtm = aligned(stride_qm, STRIDE_ALIGN), aligned(stride_qtm, STRIDE_ALIGN)
    stride_kn, stride_ktn = aligned(stride_kn, STRIDE_ALIGN), aligned(stride_ktn, STRIDE_ALIGN)
    stride_vn, stride_vtn = aligned(stride_vn, STRIDE_ALIGN), aligned(stride_vtn, STRIDE_ALIGN)
    stride_om, stride_otm = aligned(stride_om, STRIDE_ALIGN), aligned(stride_otm, STRIDE_ALIGN)
    TANGENT: tl.constexpr = HAS_Q_T or HAS_K_T or HAS_V_T or HAS_MASK_T
    # launch 1 of a boolean mask bounds the keys instead of reading the mask
    LOOP_MASK_KIND: tl.constexpr = 0 if MASK_SPLIT == 1 else MASK_KIND
    start_m = _row_block(IS_CAUSAL) * BLOCK_M
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    off_hk = off_h // GROUP
    q_start, Lq, k_start, Lk = seq_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, off_b, Lq, Lk, VARLEN)
    # packed batches: this sequence may be shorter than the longest (dense: the grid fits Lq;
    # no return there, which warp specialisation cannot take)
    if VARLEN and start_m >= Lq:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)

    q_base = Q + off_b * stride_qb + off_h * stride_qh + q_start * stride_qm
    k_base = K + off_b * stride_kb + off_hk * stride_kh + k_start * stride_kn
    v_base = V + off_b * stride_vb + off_hk * stride_vh + k_start * stride_vn
    q_t_base = Q_T + off_b * stride_qtb + off_h * stride_qth + q_start * stride_qtm
    k_t_base = K_T + off_b * stride_ktb + off_hk * stride_kth + k_start * stride_ktn
    v_t_base = V_T + off_b * stride_vtb + off_hk * stride_vth + k_start * stride_vtn
    # absent tangents' descriptors: the primal's, never read (the switches are constexpr)
    k_desc, v_desc, k_t_desc, v_t_desc = k_base, v_base, k_t_base, v_t_base
    if TMA:
        q = tile_desc(q_base, Lq, stride_qm, D, BLOCK_M, HEAD_DIM).load([start_m, 0])
        q2, q_t, q_t2 = q, q, q
        if HAS_Q_T:
            q_t = tile_desc(q_t_base, Lq, stride_qtm, D, BLOCK_M, HEAD_DIM).load([start_m, 0])
            q_t2 = q_t
        k_desc = tile_desc(k_base, Lk, stride_kn, D, BLOCK_N, HEAD_DIM)
        v_desc = tile_desc(v_base, Lk, stride_vn, DV, BLOCK_N, HEAD_DIM_V)
        k_t_desc, v_t_desc = k_desc, v_desc
        if HAS_K_T:
            k_t_desc = tile_desc(k_t_base, Lk, stride_ktn, D, BLOCK_N, HEAD_DIM)
        if HAS_V_T:
            v_t_desc = tile_desc(v_t_base, Lk, stride_vtn, DV, BLOCK_N, HEAD_DIM_V)
    else:
        q, q2 = load_split(q_base, offs_m, stride_qm, stride_qd, Lq, D, HEAD_DIM, HEAD_DIM_TAIL,
                           True)  # fmt: skip
        q_t, q_t2 = q, q2
        if HAS_Q_T:
            q_t, q_t2 = load_split(q_t_base, offs_m, stride_qtm, stride_qtd, Lq, D, HEAD_DIM,
                                   HEAD_DIM_TAIL, True)  # fmt: skip
    mask_base = MASK + off_b * stride_mb + off_h * stride_mh
    mask_t_base = MASK_T + off_b * stride_mtb + off_h * stride_mth

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    g_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    mu_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)
    acc2, acc_t2 = acc, acc_t  # the tail columns' (unused without HEAD_DIM_V_TAIL)
    if HEAD_DIM_V_TAIL > 0:
        acc2 = tl.zeros([BLOCK_M, HEAD_DIM_V_TAIL], dtype=tl.float32)
        acc_t2 = tl.zeros([BLOCK_M, HEAD_DIM_V_TAIL], dtype=tl.float32)
    qk_scale = scale * LOG2E

    # key blocks the mask leaves this block (and whether this launch owns it)
    lo, hi, k_bound, run = block_range(
        KV_RANGES, stride_rb, stride_rh, stride_rg, off_b, off_h, start_m, Lq, Lk,
        BLOCK_M, BLOCK_N, MASK_KIND, MASK_SPLIT,
    )  # fmt: skip
    if run == 0:
        return
    # Stage 0: key blocks no row masks (unmasked loads, no where); stage 1: the rest.
    full_end, end = key_range(start_m, k_bound, causal_offset, BLOCK_M, BLOCK_N, IS_CAUSAL)
    # Warp specialisation (Triton 3.6) compiles one key loop per kernel, with no pointer
    # loads in it (no attn_mask) and no early return before it (varlen): then stage 1's
    # blocks join stage 0's loop, masked from full_end on (MASK 2).
    tl.static_assert(not WS or (TMA and MASK_KIND == 0 and not HAS_MASK_T and not VARLEN))
    for stage in tl.static_range(1 if WS else 2):
        s_lo = lo if stage == 0 else tl.maximum(lo, full_end)
        s_hi = tl.minimum(full_end, hi) if stage == 0 else tl.minimum(end, hi)
        if WS:
            s_hi = tl.minimum(end, hi)
        acc, acc2, acc_t, acc_t2, m_i, l_i, g_i, mu_i = _attn_fwd_inner(
            acc, acc2, acc_t, acc_t2, m_i, l_i, g_i, mu_i, q, q2, q_t, q_t2, offs_m,
            k_desc, v_desc, k_t_desc, v_t_desc,
            k_base, v_base, k_t_base, v_t_base, mask_base, mask_t_base,
            stride_kn, stride_kd, stride_vn, stride_vd,
            stride_ktn, stride_ktd, stride_vtn, stride_vtd,
            stride_mm, stride_mn, stride_mtm, stride_mtn,
            s_lo, s_hi, Lq, k_bound, causal_offset, qk_scale, scale, mask_min,
            D, DV, HEAD_DIM, HEAD_DIM_TAIL, HEAD_DIM_V, HEAD_DIM_V_TAIL, BLOCK_N,
            2 if WS else stage,  # stage 1: every block masked; the one loop: MASK 2
            IS_CAUSAL, LOOP_MASK_KIND, MASK_SAME_ROWS, MASK_SAME_COLS,
            HAS_Q_T, HAS_K_T, HAS_V_T, HAS_MASK_T, DOT_PRECISION, TMA, MASK_SPLIT == 1,
            WS,
        )  # fmt: skip

    inv_l = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)  # fully masked rows: o = 0
    o_base = O + off_b * stride_ob + off_h * stride_oh + q_start * stride_om
    o_ty = O.dtype.element_ty
    _store_o(
        o_base,
        (acc * inv_l[:, None]).to(o_ty),
        (acc2 * inv_l[:, None]).to(o_ty),
        start_m,
        offs_m,
        stride_om,
        stride_od,
        Lq,
        DV,
        BLOCK_M,
        HEAD_DIM_V,
        HEAD_DIM_V_TAIL,
        TMA,
    )
    lse = (m_i + tl.math.log2(l_i)) * LN2
    row_offset = off_b * stride_lb + off_h * stride_lh + q_start
    _store_rows(LSE + row_offset, lse, start_m, offs_m, Lq, BLOCK_M, WS)
    if TANGENT:  # mu: 0 without a tangent of the scores
        _store_rows(MU + row_offset, mu_i, start_m, offs_m, Lq, BLOCK_M, WS)
        o_t_base = O_T + off_b * stride_otb + off_h * stride_oth + q_start * stride_otm
        _store_o(o_t_base, (acc_t * inv_l[:, None]).to(o_ty), (acc_t2 * inv_l[:, None]).to(o_ty),
                 start_m, offs_m, stride_otm, stride_otd, Lq, DV, BLOCK_M, HEAD_DIM_V,
                 HEAD_DIM_V_TAIL, TMA)  # fmt: skip
