"""Attention backward (dq, dk, dv) for Hopper (sm_90), warp-specialised, in Gluon.

The same mathematics as kernels/bwd.py (dS = P o (dP - delta), delta = rowsum(o dO) from its
preprocess, lse from the forward), in one kernel instead of its dK/dV and dQ kernels, on
FlashAttention-3's backward schedule (Shah et al., 2024, sec. 3.1). Per program of 128 keys
of one (batch, head):

- a 1-warp producer loads K and V once, then Q and dO block by block (BLOCK_M query rows)
  into a ring of STAGES slots with TMA;
- two 4-warp consumers own 64 keys each and, per block, issue S^T = K Q^T and dP^T = V dO^T,
  form P^T and dS^T in registers, accumulate dV += P^T dO and dK += dS^T Q (P^T and dS^T as
  register operands) and hand dS^T to shared memory (NB_DS buffers of both halves);
- a 4-warp dq partition forms the block's dq = dS K over all 128 keys once both halves are
  in (as dq^T = K^T dS^T where BLOCK_M is under a warpgroup product's 64 rows), releases the
  buffer and adds dq into a float32 accumulator with a TMA reduction
  (cp.reduce.async.bulk). The consumers never wait for each other, only for a free buffer.

The dq reductions' order varies from run to run: dq is not bitwise deterministic (as
FlashAttention's); dk and dv are. _ops._hopper_bwd routes here only where
torch.are_deterministic_algorithms_enabled() is off.

Scope (_ops._hopper_bwd falls back to kernels/bwd.py otherwise): fp16/bf16, HEAD_DIM 64 or
128 for q, k and v, no attn_mask, dense batches, no GQA, causal with either alignment, the primal
backward only (no tangent terms), dk and dv under 2**31 elements.
"""

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import _unwrap_if_constexpr, builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .fwd_hopper import LOG2E

HALF_N = gl.constexpr(64)  # keys per consumer: one wgmma M tile of a 4-warp group
NB_DS = gl.constexpr(2)  # dS^T buffers between the consumers and the dq partition


@builtin
def _tma_reduce_add(desc, coord, value, _semantic=None):
    """``value`` added into ``desc``'s block at ``coord`` by a TMA reduction: Triton's
    descriptor_atomic_add, which Gluon 3.6 does not wrap; its TMA lowering stages ``value``
    through shared memory and waits only for that to be read (cp.reduce.async.bulk.tensor)."""
    shape = [_unwrap_if_constexpr(n) for n in value.shape]
    block = [_unwrap_if_constexpr(n) for n in desc.block_type.shape]
    if shape != block or value.dtype != desc.block_type.element_ty or len(coord) != len(block):
        got = f"a {value.dtype} {shape} value at {len(coord)} coordinates"
        raise ValueError(f"_tma_reduce_add: {got} into {desc.block_type.element_ty} {block} blocks")
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    kind = ir.DESCRIPTOR_REDUCE_KIND.ADD
    _semantic.builder.create_descriptor_reduce(kind, desc.handle, value.handle, coord)


@gluon.jit
def _load_partition(args, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """Producer: K and V of both consumers once, then Q and dO per query block."""
    (q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem, kv_bar, q_ready,
     q_empty, off_b, off_h, start_n, lo, n_m) = args  # fmt: skip
    mbarrier.expect(kv_bar, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for c in gl.static_range(2):
        key = start_n + c * HALF_N
        tma.async_copy_global_to_shared(k_desc, [off_b, off_h, key, 0], kv_bar, k_smem.index(c))
        tma.async_copy_global_to_shared(v_desc, [off_b, off_h, key, 0], kv_bar, v_smem.index(c))
    block_bytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
    for j in range(n_m):
        s = j % STAGES
        # a fresh barrier counts as released once (parity 1), so the first round passes
        mbarrier.wait(q_empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(q_ready.index(s), block_bytes)
        row = (lo + j) * BLOCK_M
        tma.async_copy_global_to_shared(q_desc, [off_b, off_h, row, 0], q_ready.index(s),
                                        q_smem.index(s))  # fmt: skip
        tma.async_copy_global_to_shared(do_desc, [off_b, off_h, row, 0], q_ready.index(s),
                                        do_smem.index(s))  # fmt: skip


@gluon.jit
def _probs(s_t, offs_m, lse, offs_n, key0, row0, qk_scale, causal_offset, Lk,
           IS_CAUSAL: gl.constexpr):  # fmt: skip
    """P^T of one query block (rows from row0) from S^T: zero for keys past Lk (read as zeros,
    and dq reads dS there) and, causal, for keys after a row's last (i + causal_offset)."""
    p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse * LOG2E, 0))
    if key0 + HALF_N > Lk:
        p_t = gl.where(gl.expand_dims(offs_n < Lk, 1), p_t, 0.0)
    # only the blocks that cross the diagonal pay for the select (rows that see no key
    # included: their lse is not finite)
    if IS_CAUSAL and row0 + causal_offset < key0 + HALF_N - 1:
        keep = gl.expand_dims(offs_n, 1) <= gl.expand_dims(offs_m + causal_offset, 0)
        p_t = gl.where(keep, p_t, 0.0)
    return p_t


@gluon.jit
def _block_products(k, v, q_smem, do_smem, q_ready, dv, dk, s_zero, lse_row, delta_row, offs_n,
                    key0, row0, j, qk_scale, causal_offset, Lq, Lk, HEAD_DIM: gl.constexpr,
                    BLOCK_M: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                    col_s: gl.constexpr, a_layout: gl.constexpr):  # fmt: skip
    """Block j (query rows from row0) up to dV's and dK's products, issued (in flight):
    returns dS^T, dv and dk. Rows past Lq: lse +inf, so P = 0 (their q and dO read as 0)."""
    dtype: gl.constexpr = q_smem.dtype
    offs_m = row0 + gl.arange(0, BLOCK_M, layout=col_s)
    lse = gl.load(lse_row + offs_m, mask=offs_m < Lq, other=float("inf"))
    delta = gl.load(delta_row + offs_m, mask=offs_m < Lq, other=0.0)
    s = j % STAGES
    mbarrier.wait(q_ready.index(s), (j // STAGES) & 1)
    q = q_smem.index(s).reshape([BLOCK_M, HEAD_DIM])
    do = do_smem.index(s).reshape([BLOCK_M, HEAD_DIM])
    s_t = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp_t = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s_t, dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, dp_t))
    p_t = _probs(s_t, offs_m, lse, offs_n, key0, row0, qk_scale, causal_offset, Lk, IS_CAUSAL)
    # dV's product is issued first, so dS^T is formed while the tensor cores run it
    p_op = gl.convert_layout(p_t.to(dtype), a_layout)
    dv = warpgroup_mma(p_op, do, dv, is_async=True)
    ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
    ds_op = gl.convert_layout(ds_t.to(dtype), a_layout)
    dk = warpgroup_mma(ds_op, q, dk, is_async=True)
    return ds_t, dv, dk


@gluon.jit
def _dkdv_partition(args, C: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                    STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):  # fmt: skip
    """Consumer C: keys start_n + C * 64 ... + 63; dS^T of each block into its half of a
    dS^T buffer; dk (scaled) and dv stored at the end."""
    (q_smem, k_smem, v_smem, do_smem, ds_smem, kv_bar, ds_full, ds_empty, q_ready, q_empty,
     lse_row, delta_row, dk_head, dv_head, stride_dkn, stride_dvn, start_n, lo, n_m, scale,
     causal_offset, Lq, Lk) = args  # fmt: skip
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)  # along queries
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)  # along keys
    dtype: gl.constexpr = q_smem.dtype

    qk_scale = scale * LOG2E
    key0 = start_n + C * HALF_N
    offs_n = key0 + gl.arange(0, HALF_N, layout=row_s)
    dk = gl.zeros([HALF_N, HEAD_DIM], gl.float32, layout=o_layout)
    dv = gl.zeros([HALF_N, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([HALF_N, BLOCK_M], gl.float32, layout=s_layout)

    mbarrier.wait(kv_bar, 0)
    k = k_smem.index(C).reshape([HALF_N, HEAD_DIM])
    v = v_smem.index(C).reshape([HALF_N, HEAD_DIM])
    for j in range(n_m):
        row0 = (lo + j) * BLOCK_M
        ds_t, dv, dk = _block_products(k, v, q_smem, do_smem, q_ready, dv, dk, s_zero, lse_row,
                                       delta_row, offs_n, key0, row0, j, qk_scale,
                                       causal_offset, Lq, Lk, HEAD_DIM, BLOCK_M, STAGES,
                                       IS_CAUSAL, col_s, a_layout)  # fmt: skip
        b = j % NB_DS
        mbarrier.wait(ds_empty.index(b), ((j // NB_DS) & 1) ^ 1)  # fresh: passes
        ds_smem.index(b).slice(C * HALF_N, HALF_N).store(ds_t.to(dtype))
        fence_async_shared()
        mbarrier.arrive(ds_full.index(b), count=1)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        mbarrier.arrive(q_empty.index(j % STAGES), count=1)

    rows = key0 + gl.arange(0, HALF_N, layout=row_o)
    cols = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout)), 0)
    keep_rows = gl.expand_dims(rows < Lk, 1)
    # one output's addresses at a time, dv's freed first: at HEAD_DIM 128 both outputs'
    # addresses beside both accumulators spill
    dv_ptrs = dv_head + gl.expand_dims(rows, 1) * stride_dvn
    gl.store(dv_ptrs + cols, dv.to(dtype), mask=keep_rows)
    dk_ptrs = dk_head + gl.expand_dims(rows, 1) * stride_dkn
    gl.store(dk_ptrs + cols, (dk * scale).to(dtype), mask=keep_rows)


@gluon.jit
def _dq_partition(args, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                  DQ_TRANSPOSED: gl.constexpr):  # fmt: skip
    """Per query block, once both consumers' dS^T halves are in buffer j % NB_DS: dq = dS K
    over the 128 keys (DQ_TRANSPOSED: dq^T = K^T dS^T, as a warpgroup's product needs 64 rows
    and BLOCK_M is less), the buffer released, dq added at its rows by a TMA reduction."""
    (ds_smem, k_smem, kv_bar, ds_full, ds_empty, dq_desc, dq_row0, lo, n_m) = args
    if DQ_TRANSPOSED:
        shape: gl.constexpr = [HEAD_DIM, BLOCK_M]
    else:
        shape: gl.constexpr = [BLOCK_M, HEAD_DIM]
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, shape[1], 16]
    )
    dq_zero = gl.zeros(shape, gl.float32, layout=dq_layout)
    mbarrier.wait(kv_bar, 0)
    for j in range(n_m):
        b = j % NB_DS
        mbarrier.wait(ds_full.index(b), (j // NB_DS) & 1)
        dq = dq_zero
        for c in gl.static_range(2):  # each consumer's keys: dS[:, keys of c] K[keys of c]
            ds_c = ds_smem.index(b).slice(c * HALF_N, HALF_N)
            k_c = k_smem.index(c).reshape([HALF_N, HEAD_DIM])
            if DQ_TRANSPOSED:
                dq = warpgroup_mma(k_c.permute((1, 0)), ds_c, dq, use_acc=c > 0, is_async=True)
            else:
                dq = warpgroup_mma(ds_c.permute((1, 0)), k_c, dq, use_acc=c > 0, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        mbarrier.arrive(ds_empty.index(b), count=1)
        # each (batch, head) owns a whole number of query blocks of dq_desc (rows, or
        # transposed columns, from dq_row0): rows past Lq land in its own padding, never in
        # the next head's rows (with inf or NaN in k or v they would not be zero)
        row = (lo + j) * BLOCK_M
        if DQ_TRANSPOSED:
            _tma_reduce_add(dq_desc, [dq_row0, row], dq)
        else:
            _tma_reduce_add(dq_desc, [dq_row0 + row, 0], dq)


@gluon.jit
def attn_bwd_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, LSE, DELTA, DK, DV,
                           stride_lb, stride_lh, stride_dkb, stride_dkh, stride_dkn, stride_dvb,
                           stride_dvh, stride_dvn, scale, causal_offset, H, Lq, Lk,
                           HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                           IS_CAUSAL: gl.constexpr, DQ_TRANSPOSED: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr, DQ_REGS: gl.constexpr):  # fmt: skip
    """dk, dv and this program's shares of dq for 128 keys of one (batch, head); see the
    module docstring. Descriptors are rank 4 over (B, H, L, E): q and do in blocks of BLOCK_M
    rows, k and v of 64; dq_desc rank 2 over the float32 dq accumulator as (B H Lq', E)
    with Lq' = Lq rounded up to BLOCK_M, blocks of BLOCK_M rows (dq = scale * the sum), or
    with DQ_TRANSPOSED (BLOCK_M < 64) over dq^T's as (B H E, Lq'), blocks of E x BLOCK_M.
    LSE and DELTA: (B, H, Lq), rows contiguous. CONSUMER_REGS, DQ_REGS: registers per
    thread (setmaxnreg) of consumer 1 and the dq partition (consumer 0, the default
    partition, gets what the others leave)."""
    start_n = gl.program_id(0) * 2 * HALF_N
    off_bh = gl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    lo = 0
    if IS_CAUSAL:  # the first query block with a row that sees one of these keys
        lo = gl.maximum(start_n - causal_offset, 0) // BLOCK_M
    n_m = gl.cdiv(Lq, BLOCK_M) - lo  # <= 0: no row sees these keys; dk = dv = 0

    dtype: gl.constexpr = q_desc.dtype
    q_shape: gl.constexpr = [STAGES] + q_desc.block_type.shape
    kv_shape: gl.constexpr = [2] + k_desc.block_type.shape
    q_smem = gl.allocate_shared_memory(dtype, q_shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, q_shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, kv_shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, kv_shape, v_desc.layout)
    # both consumers' dS^T, the dq partition's operand (read transposed, or as stored with
    # DQ_TRANSPOSED)
    # rows of BLOCK_M 16-bit values: 128 bytes at 64 (the widest swizzle), 64 at 32
    gl.static_assert(BLOCK_M == 32 or BLOCK_M == 64, "BLOCK_M: 32 or 64")
    ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * BLOCK_M,
                                                   element_bitwidth=16)  # fmt: skip
    ds_smem = gl.allocate_shared_memory(dtype, [NB_DS, 2 * HALF_N, BLOCK_M], ds_layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    ds_full = gl.allocate_shared_memory(gl.int64, [NB_DS, 1], bar_layout)
    ds_empty = gl.allocate_shared_memory(gl.int64, [NB_DS, 1], bar_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    mbarrier.init(kv_bar, count=1)
    for b in gl.static_range(NB_DS):
        mbarrier.init(ds_full.index(b), count=2)  # one arrival per consumer
        mbarrier.init(ds_empty.index(b), count=1)  # the dq partition's
    for s in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(q_empty.index(s), count=2)  # one arrival per consumer

    # this (batch, head)'s rows of lse, delta, dk and dv: fewer values live through the
    # consumers' loop than with their strides (at HEAD_DIM 128 they spill)
    lse_row = LSE + off_b * stride_lb + off_h * stride_lh
    delta_row = DELTA + off_b * stride_lb + off_h * stride_lh
    dk_head = DK + off_b * stride_dkb + off_h * stride_dkh
    dv_head = DV + off_b * stride_dvb + off_h * stride_dvh
    args = (q_smem, k_smem, v_smem, do_smem, ds_smem, kv_bar, ds_full, ds_empty, q_ready,
            q_empty, lse_row, delta_row, dk_head, dv_head, stride_dkn, stride_dvn, start_n, lo,
            n_m, scale, causal_offset, Lq, Lk)  # fmt: skip
    load_args = (q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem, kv_bar,
                 q_ready, q_empty, off_b, off_h, start_n, lo, n_m)  # fmt: skip
    if DQ_TRANSPOSED:  # dq_desc's rows per (batch, head)
        dq_rows = HEAD_DIM
    else:
        dq_rows = gl.cdiv(Lq, BLOCK_M) * BLOCK_M
    dq_args = (ds_smem, k_smem, kv_bar, ds_full, ds_empty, dq_desc, off_bh * dq_rows, lo, n_m)
    gl.warp_specialize(
        [
            (_dkdv_partition, (args, 0, HEAD_DIM, BLOCK_M, STAGES, IS_CAUSAL)),
            (_dkdv_partition, (args, 1, HEAD_DIM, BLOCK_M, STAGES, IS_CAUSAL)),
            (_load_partition, (load_args, BLOCK_M, STAGES)),
            (_dq_partition, (dq_args, HEAD_DIM, BLOCK_M, DQ_TRANSPOSED)),
        ],
        [4, 1, 4],
        [CONSUMER_REGS, 24, DQ_REGS],
    )  # fmt: skip
