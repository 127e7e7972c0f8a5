"""Attention forward (and forward + JVP) for Hopper (sm_90), warp-specialised, in Gluon.

The same mathematics as kernels/fwd.py (FlashAttention-2 online softmax; the tangent carried
as g = rowsum(P o S_t), its running mean mu and one centred accumulator acc_t, see there), on
the schedule FlashAttention-3 uses on Hopper (Shah et al., 2024, sec. 3.1): per program of
BLOCK_M = 64 x CONSUMERS query rows,

- a 1-warp producer moves Q (and Q_t) once and K, V (and K_t, V_t) block by block into
  rings of STAGES shared-memory slots with TMA, waiting on each slot's "empty" barrier;
- CONSUMERS (2 or 3) 4-warp consumers of 64 rows each wait on a slot's "ready" barrier,
  issue their wgmma products straight from shared memory, run the softmax in registers and
  release the slot; while one consumer is in its softmax another's products keep the tensor
  cores busy (FlashAttention-3 runs three at head dim 64, where the softmax weighs more).

Tiles move through rank-4 host tensor descriptors over the (B, H, L, E) views (any strides
TMA accepts), so rows past Lq or Lk read as zeros and no other head's data is touched.

Scope (see _ops._hopper, which routes here and falls back to kernels/fwd.py otherwise):
fp16/bf16, HEAD_DIM 64 or 128 for q, k and v alike, no attn_mask, dense batches (no varlen),
GQA, causal with either alignment, every tangent of q, k, v present or none, no input
expanded with a stride of 0, o under 2**31 elements (its pointer offsets are 32-bit).

Switches: O_TMA stores o (and o_t) through each consumer's Q (Q_t) slot and TMA instead of
per-element pointers; OVERLAP (primal only) orders each consumer's products as
FlashAttention-3 does, so a block's softmax runs during the previous block's P V;
CONSUMER_REGS: registers per thread (setmaxnreg) of consumers 1.. (consumer 0, the default
partition, gets what the others leave; see configs.HopperConfig).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)
HALF_M = gl.constexpr(64)  # rows per consumer: one wgmma M tile of a 4-warp group


@gluon.jit
def _load_partition(args, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, TANGENT: gl.constexpr,
                    CONSUMERS: gl.constexpr):  # fmt: skip
    """Producer: Q (and Q_t) for every consumer, then K and V (and their tangents) per key
    block into the rings; a slot is refilled once every consumer has released it."""
    (q_desc, k_desc, v_desc, qt_desc, kt_desc, vt_desc, q_smem, k_smem, v_smem, qt_smem, kt_smem,
     vt_smem, q_bar, k_ready, k_empty, v_ready, v_empty, off_b, off_h, off_hk, start_m,
     n_blocks) = args  # fmt: skip
    q_bytes: gl.constexpr = q_desc.block_type.nbytes
    k_bytes: gl.constexpr = k_desc.block_type.nbytes
    v_bytes: gl.constexpr = v_desc.block_type.nbytes
    n_t: gl.constexpr = 2 if TANGENT else 1  # tiles per barrier: the primal's and its tangent
    mbarrier.expect(q_bar, CONSUMERS * n_t * q_bytes)
    for c in gl.static_range(CONSUMERS):
        row = start_m + c * HALF_M
        tma.async_copy_global_to_shared(q_desc, [off_b, off_h, row, 0], q_bar, q_smem.index(c))
        if TANGENT:
            tma.async_copy_global_to_shared(qt_desc, [off_b, off_h, row, 0], q_bar,
                                            qt_smem.index(c))  # fmt: skip
    for i in range(n_blocks):
        s = i % STAGES
        phase = (i // STAGES) & 1
        start_n = i * BLOCK_N
        # a fresh barrier counts as released once (parity 1), so the first round passes
        mbarrier.wait(k_empty.index(s), phase ^ 1)
        mbarrier.expect(k_ready.index(s), n_t * k_bytes)
        tma.async_copy_global_to_shared(k_desc, [off_b, off_hk, start_n, 0], k_ready.index(s),
                                        k_smem.index(s))  # fmt: skip
        if TANGENT:
            tma.async_copy_global_to_shared(kt_desc, [off_b, off_hk, start_n, 0],
                                            k_ready.index(s), kt_smem.index(s))  # fmt: skip
        mbarrier.wait(v_empty.index(s), phase ^ 1)
        mbarrier.expect(v_ready.index(s), n_t * v_bytes)
        tma.async_copy_global_to_shared(v_desc, [off_b, off_hk, start_n, 0], v_ready.index(s),
                                        v_smem.index(s))  # fmt: skip
        if TANGENT:
            tma.async_copy_global_to_shared(vt_desc, [off_b, off_hk, start_n, 0],
                                            v_ready.index(s), vt_smem.index(s))  # fmt: skip


@gluon.jit
def _online_softmax(qk, m_i, l_i, start_n, offs_m, row0, qk_scale, causal_offset, Lk,
                    BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr,
                    col_s: gl.constexpr):  # fmt: skip
    """One key block's step of the online softmax on raw scores qk: (p, alpha, m, l), p
    relative to the new running max m, alpha = the old max's correction."""
    qk = qk * qk_scale
    # keys past Lk (zero-filled by TMA) and, causal, keys past the diagonal: -inf;
    # only the blocks that reach either pay for the select
    last_key = start_n + BLOCK_N - 1
    need_mask = last_key >= Lk
    if IS_CAUSAL:
        need_mask = need_mask | (last_key > row0 + causal_offset)
    if need_mask:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=col_s)
        keep = gl.expand_dims(offs_n < Lk, 0)
        if IS_CAUSAL:
            last = gl.expand_dims(offs_m, 1) + causal_offset  # each row's last key
            keep = keep & (gl.expand_dims(offs_n, 0) <= last)
        qk = gl.where(keep, qk, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, axis=1))
    # a row with no visible key so far keeps m = -inf; 0 makes exp2 give 0, not NaN
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(qk - gl.expand_dims(m_use, 1))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _issue_pv(acc, alpha, p_op, v_smem, v_ready, j, HEAD_DIM: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, row_o: gl.constexpr):  # fmt: skip
    """acc rescaled to block j's running max, then block j's P V issued (not waited)."""
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    mbarrier.wait(v_ready.index(j % STAGES), (j // STAGES) & 1)
    v = v_smem.index(j % STAGES).reshape([BLOCK_N, HEAD_DIM])
    return warpgroup_mma(p_op, v, acc, is_async=True)


@gluon.jit
def _primal_overlapped(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, acc, m_i, l_i,
                       s_zero, n_blocks, offs_m, row0, qk_scale, causal_offset, Lk,
                       HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       IS_CAUSAL: gl.constexpr, col_s: gl.constexpr, row_o: gl.constexpr,
                       p_layout: gl.constexpr):  # fmt: skip
    """The primal key loop in FlashAttention-3's order (Shah et al., 2024, sec. 3.2): block
    i's S = Q K^T is issued before block i-1's P V, so block i's softmax runs while the tensor
    cores do that P V; each product is waited in the iteration that issues it (ptxas then
    keeps them in flight). Needs n_blocks >= 1. Returns (acc, m, l) as the plain loop."""
    mbarrier.wait(k_ready.index(0), 0)
    k = k_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
    qk = warpgroup_mma(q, k, s_zero, use_acc=False, is_async=True)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, alpha, m_i, l_i = _online_softmax(qk, m_i, l_i, 0, offs_m, row0, qk_scale, causal_offset,
                                         Lk, BLOCK_N, IS_CAUSAL, col_s)  # fmt: skip
    p_op = gl.convert_layout(p.to(q.dtype), p_layout)
    for i in range(1, n_blocks):
        s = i % STAGES
        prev = (i - 1) % STAGES
        mbarrier.wait(k_ready.index(s), (i // STAGES) & 1)
        k = k_smem.index(s).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
        qk = warpgroup_mma(q, k, s_zero, use_acc=False, is_async=True)
        acc = _issue_pv(acc, alpha, p_op, v_smem, v_ready, i - 1, HEAD_DIM, BLOCK_N, STAGES,
                        row_o)  # fmt: skip
        qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk,))
        mbarrier.arrive(k_empty.index(s), count=1)
        p, alpha, m_i, l_i = _online_softmax(qk, m_i, l_i, i * BLOCK_N, offs_m, row0, qk_scale,
                                             causal_offset, Lk, BLOCK_N, IS_CAUSAL,
                                             col_s)  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(v_empty.index(prev), count=1)
        p_op = gl.convert_layout(p.to(q.dtype), p_layout)
    acc = _issue_pv(acc, alpha, p_op, v_smem, v_ready, n_blocks - 1, HEAD_DIM, BLOCK_N, STAGES,
                    row_o)  # fmt: skip
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(v_empty.index((n_blocks - 1) % STAGES), count=1)
    return acc, m_i, l_i


@gluon.jit
def _softmax_partition(args, C: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, TANGENT: gl.constexpr,
                       O_TMA: gl.constexpr, OVERLAP: gl.constexpr):  # fmt: skip
    """Consumer C: rows start_m + C * 64 ... + 63 of the program's query block; ``args``: the
    kernel's tuple of shared values (a tuple keeps no constexpr: those come one by one)."""
    (q_smem, k_smem, v_smem, qt_smem, kt_smem, vt_smem, q_bar, k_ready, k_empty, v_ready,
     v_empty, o_desc, ot_desc, O, O_T, LSE, MU, stride_ob, stride_oh, stride_om, stride_otb,
     stride_oth, stride_otm, stride_lb, stride_lh, off_b, off_h, start_m, n_blocks, scale,
     causal_offset, Lq, Lk) = args  # fmt: skip
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype

    qk_scale = scale * LOG2E
    row0 = start_m + C * HALF_M
    offs_m = row0 + gl.arange(0, HALF_M, layout=row_s)
    m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([HALF_M], gl.float32, layout=row_s)
    g_i = gl.zeros([HALF_M], gl.float32, layout=row_s)
    mu_i = gl.zeros([HALF_M], gl.float32, layout=row_s)
    acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, layout=o_layout)
    acc_t = gl.zeros([HALF_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)

    mbarrier.wait(q_bar, 0)
    q = q_smem.index(C).reshape([HALF_M, HEAD_DIM])
    q_t = qt_smem.index(C).reshape([HALF_M, HEAD_DIM])
    if OVERLAP:  # primal only
        acc, m_i, l_i = _primal_overlapped(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                                           acc, m_i, l_i, s_zero, n_blocks, offs_m, row0,
                                           qk_scale, causal_offset, Lk, HEAD_DIM, BLOCK_N,
                                           STAGES, IS_CAUSAL, col_s, row_o,
                                           p_layout)  # fmt: skip
    else:
        for i in range(n_blocks):
            s = i % STAGES
            phase = (i // STAGES) & 1
            start_n = i * BLOCK_N
            mbarrier.wait(k_ready.index(s), phase)
            k = k_smem.index(s).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
            qk = warpgroup_mma(q, k, s_zero, use_acc=False, is_async=True)
            if TANGENT:
                k_t = kt_smem.index(s).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
                s_t = warpgroup_mma(q_t, k, s_zero, use_acc=False, is_async=True)
                s_t = warpgroup_mma(q, k_t, s_t, is_async=True)
                qk, s_t = warpgroup_mma_wait(num_outstanding=0, deps=(qk, s_t))
            else:
                qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
            mbarrier.arrive(k_empty.index(s), count=1)

            p, alpha, m_new, l_i = _online_softmax(qk, m_i, l_i, start_n, offs_m, row0, qk_scale,
                                                   causal_offset, Lk, BLOCK_N, IS_CAUSAL,
                                                   col_s)  # fmt: skip
            alpha_o = gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            acc = acc * alpha_o
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            if TANGENT:
                # centred on the running mean mu, as in kernels/fwd.py (keeps products small)
                g_i = g_i * alpha + gl.sum(p * s_t, axis=1) * scale
                mu_new = g_i / gl.where(l_i == 0.0, 1.0, l_i)
                p_s_t = p * (s_t * scale - gl.expand_dims(mu_new, 1))
                d_mu = gl.expand_dims(gl.convert_layout(mu_new - mu_i, row_o), 1)
                acc_t = acc_t * alpha_o - d_mu * acc
                mu_i = mu_new
                p_s_t_op = gl.convert_layout(p_s_t.to(dtype), p_layout)
            m_i = m_new

            mbarrier.wait(v_ready.index(s), phase)
            v = v_smem.index(s).reshape([BLOCK_N, HEAD_DIM])
            if TANGENT:
                v_t = vt_smem.index(s).reshape([BLOCK_N, HEAD_DIM])
                acc_t = warpgroup_mma(p_s_t_op, v, acc_t, is_async=True)
                acc_t = warpgroup_mma(p_op, v_t, acc_t, is_async=True)
                acc = warpgroup_mma(p_op, v, acc, is_async=True)
                acc, acc_t = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_t))
            else:
                acc = warpgroup_mma(p_op, v, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(v_empty.index(s), count=1)

    # rows with no visible key: o = o_t = 0, lse = -inf (as kernels/fwd.py)
    inv_l = gl.expand_dims(gl.convert_layout(1.0 / gl.where(l_i == 0.0, 1.0, l_i), row_o), 1)
    if O_TMA:
        # through this consumer's Q (and Q_t) slot, free now, and TMA (rows past Lq are
        # clipped): no per-element addresses in registers, which beside two 128-column
        # accumulators spilled
        o_smem = q_smem.index(C)
        o_smem.reshape([HALF_M, HEAD_DIM]).store((acc * inv_l).to(dtype))
        if TANGENT:
            qt_smem.index(C).reshape([HALF_M, HEAD_DIM]).store((acc_t * inv_l).to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [off_b, off_h, row0, 0], o_smem)
        if TANGENT:
            tma.async_copy_shared_to_global(ot_desc, [off_b, off_h, row0, 0], qt_smem.index(C))
        tma.store_wait(0)
    else:
        rows_o = row0 + gl.arange(0, HALF_M, layout=row_o)
        cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        store_mask = gl.expand_dims(rows_o < Lq, 1)
        o_offs = gl.expand_dims(rows_o, 1) * stride_om + gl.expand_dims(cols_o, 0)
        o_base = O + off_b * stride_ob + off_h * stride_oh
        gl.store(o_base + o_offs, (acc * inv_l).to(dtype), mask=store_mask)
    row_offset = off_b * stride_lb + off_h * stride_lh
    lse = (m_i + gl.log2(l_i)) * LN2
    gl.store(LSE + row_offset + offs_m, lse, mask=offs_m < Lq)
    if TANGENT:
        gl.store(MU + row_offset + offs_m, mu_i, mask=offs_m < Lq)
        if not O_TMA:
            ot_offs = gl.expand_dims(rows_o, 1) * stride_otm + gl.expand_dims(cols_o, 0)
            ot_base = O_T + off_b * stride_otb + off_h * stride_oth
            gl.store(ot_base + ot_offs, (acc_t * inv_l).to(dtype), mask=store_mask)


@gluon.jit
def attn_fwd_hopper_kernel(q_desc, k_desc, v_desc, qt_desc, kt_desc, vt_desc,
                           o_desc, ot_desc, O, O_T, LSE, MU,
                           stride_ob, stride_oh, stride_om, stride_otb, stride_oth, stride_otm,
                           stride_lb, stride_lh, scale, causal_offset, H, GROUP, Lq, Lk,
                           HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                           IS_CAUSAL: gl.constexpr, TANGENT: gl.constexpr,
                           O_TMA: gl.constexpr, OVERLAP: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr, CONSUMERS: gl.constexpr):  # fmt: skip
    """o (and o_t, lse, mu) of one BLOCK_M-row query block of one (batch, head); see the module
    docstring. Descriptors are rank 4 over (B, H, L, E) with blocks [1, 1, rows, HEAD_DIM];
    absent tangents' descriptors are the primal's, never read (TANGENT is compile-time)."""
    gl.static_assert(CONSUMERS == 2 or CONSUMERS == 3, "two or three consumers")
    # registers a thread's warpgroups share (the producer's padded to one), of which Triton
    # gives consumer 0, the default partition, what the others leave (configs.HopperConfig)
    SHARE: gl.constexpr = (CONSUMERS + 1) * (512 // (CONSUMERS + 1) // 8 * 8)
    gl.static_assert(SHARE - (CONSUMERS - 1) * CONSUMER_REGS - 24 >= CONSUMER_REGS, "registers")
    BLOCK_M: gl.constexpr = CONSUMERS * HALF_M
    pid_m = gl.program_id(0)
    if IS_CAUSAL:  # longest blocks first, so the grid's last wave is its shortest
        pid_m = gl.num_programs(0) - 1 - pid_m
    off_bh = gl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    off_hk = off_h // GROUP
    start_m = pid_m * BLOCK_M
    hi = Lk
    if IS_CAUSAL:  # row i sees keys j <= i + causal_offset
        hi = gl.minimum(hi, gl.maximum(start_m + BLOCK_M + causal_offset, 0))
    n_blocks = gl.cdiv(hi, BLOCK_N)
    if OVERLAP:  # its first block is peeled: a block of rows that sees no key reads one, masked
        gl.static_assert(not TANGENT, "OVERLAP is for the primal forward")
        n_blocks = gl.maximum(n_blocks, 1)

    dtype: gl.constexpr = q_desc.dtype
    q_shape: gl.constexpr = [CONSUMERS] + q_desc.block_type.shape
    kv_shape: gl.constexpr = [STAGES] + k_desc.block_type.shape
    q_smem = gl.allocate_shared_memory(dtype, q_shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, kv_shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, kv_shape, v_desc.layout)
    qt_smem, kt_smem, vt_smem = q_smem, k_smem, v_smem
    if TANGENT:
        qt_smem = gl.allocate_shared_memory(dtype, q_shape, qt_desc.layout)
        kt_smem = gl.allocate_shared_memory(dtype, kv_shape, kt_desc.layout)
        vt_smem = gl.allocate_shared_memory(dtype, kv_shape, vt_desc.layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=CONSUMERS)  # one arrival per consumer
        mbarrier.init(v_empty.index(s), count=CONSUMERS)

    args = (q_smem, k_smem, v_smem, qt_smem, kt_smem, vt_smem, q_bar, k_ready, k_empty,
            v_ready, v_empty, o_desc, ot_desc, O, O_T, LSE, MU, stride_ob, stride_oh,
            stride_om, stride_otb, stride_oth, stride_otm, stride_lb, stride_lh, off_b, off_h,
            start_m, n_blocks, scale, causal_offset, Lq, Lk)  # fmt: skip
    load_args = (q_desc, k_desc, v_desc, qt_desc, kt_desc, vt_desc, q_smem, k_smem, v_smem,
                 qt_smem, kt_smem, vt_smem, q_bar, k_ready, k_empty, v_ready, v_empty, off_b,
                 off_h, off_hk, start_m, n_blocks)  # fmt: skip
    # consumer 0 is the default partition (the kernel's 4 warps); the other consumers and the
    # producer warp are workers. (A (function, arguments) pair cannot be a variable.)
    if CONSUMERS == 3:
        gl.warp_specialize(
            [
                (_softmax_partition, (args, 0, HEAD_DIM, BLOCK_N, STAGES, IS_CAUSAL, TANGENT,
                                      O_TMA, OVERLAP)),
                (_softmax_partition, (args, 1, HEAD_DIM, BLOCK_N, STAGES, IS_CAUSAL, TANGENT,
                                      O_TMA, OVERLAP)),
                (_softmax_partition, (args, 2, HEAD_DIM, BLOCK_N, STAGES, IS_CAUSAL, TANGENT,
                                      O_TMA, OVERLAP)),
                (_load_partition, (load_args, BLOCK_N, STAGES, TANGENT, CONSUMERS)),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, CONSUMER_REGS, 24],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_softmax_partition, (args, 0, HEAD_DIM, BLOCK_N, STAGES, IS_CAUSAL, TANGENT,
                                      O_TMA, OVERLAP)),
                (_softmax_partition, (args, 1, HEAD_DIM, BLOCK_N, STAGES, IS_CAUSAL, TANGENT,
                                      O_TMA, OVERLAP)),
                (_load_partition, (load_args, BLOCK_N, STAGES, TANGENT, CONSUMERS)),
            ],
            [4, 1],
            [CONSUMER_REGS, 24],
        )  # fmt: skip
