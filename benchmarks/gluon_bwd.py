"""Prototype (issue 25's backward): the primal dK/dV kernel in Gluon, warp-specialised as the
Gluon forward (kernels/fwd_hopper.py), against our Triton dK/dV kernel (kernels/bwd.py).
Not used by the library; a step towards a Hopper backward at cuDNN's speed.

    python benchmarks/gluon_bwd.py compile            # sm_90 compile report, any machine
    python benchmarks/gluon_bwd.py check              # dk, dv against float64 (Hopper)
    python benchmarks/gluon_bwd.py time [--out DIR]   # against our dK/dV kernel (Hopper)

Schedule, per program of 128 keys of one (batch, head) (FlashAttention-3's backward, Shah et
al., 2024, sec. 3.1, without its dQ): a 1-warp producer loads K and V once and Q, dO block by
block (BLOCK_M query rows) into a ring of STAGES slots with TMA; two 4-warp consumers own 64
keys each and, per block, issue S^T = K Q^T and dP^T = V dO^T together, form
P^T = exp(S^T - lse) and dS^T = P^T (dP^T - delta) in registers, and accumulate
dV += P^T dO and dK += dS^T Q with P^T and dS^T as register operands. delta = rowsum(o dO)
as kernels/bwd.py's preprocess; lse from the forward. Scope: fp16/bf16, HEAD_DIM 64 or 128,
no mask, no GQA, dense, causal with Lq == Lk (top-left).

That schedule ran 0.93-1.10x our dK/dV kernel's speed on an H100; OVERLAP (block j's S^T
and dP^T issued ahead of block j-1's dV and dK products, as the forward's OVERLAP) 0.75-0.96x.
With dq fused (DQ modes below; cuDNN's whole backward takes 1.05-1.3x our dK/dV kernel's
time), against our dK/dV + dQ kernels: element atomics 0.59-0.67x, a TMA reduction a
consumer 0.75-0.88x, one TMA reduction a block of both consumers' dS K (DQ_SHARED, then with
a runtime branch) 0.88-0.96x; its compile-time form (blocks in pairs) is not yet run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import sys

import torch
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

from flash_jvp.kernels.fwd_hopper import LOG2E

HALF_N = gl.constexpr(64)  # keys per consumer: one wgmma M tile of a 4-warp group
# DQ modes: each consumer's dS K share added into a float32 dq by element atomics, or by a
# TMA reduction of the whole block (FlashAttention-3's dQ path); DQ_SHARED: both consumers'
# dS^T through shared memory, one consumer a block (alternating) forms the block's dq from
# all 128 keys and adds it by a TMA reduction (half DQ_TMA's reduction traffic);
# DQ_SHARED_C0: consumer 0 every block
DQ_ATOMIC = gl.constexpr(1)
DQ_TMA = gl.constexpr(2)
DQ_SHARED = gl.constexpr(3)
DQ_SHARED_C0 = gl.constexpr(4)
# DQ_WG: a third 4-warp partition forms dq = dS K from both consumers' dS^T in shared memory
# (NB_DS buffers) and reduces it; the consumers never wait for each other, only for a free
# dS^T buffer (FlashAttention-3's dQ path moved off the consumers)
DQ_WG = gl.constexpr(5)
NB_DS = gl.constexpr(2)
# timing only (racy or wrong dq, never checked): 1 skips dq's TMA reduction
WG_REGS = gl.constexpr(
    tuple(int(r) for r in os.environ.get("GLUON_BWD_WG_REGS", "208,80").split(","))
)
ABLATE = gl.constexpr(int(os.environ.get("GLUON_BWD_ABLATE", "0")))


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
def _row_stats(LSE, DELTA, row_base, j, lo, Lq, BLOCK_M: gl.constexpr, col_s: gl.constexpr):
    """Query block lo + j's offsets, lse and delta; rows past Lq: lse +inf, so P = 0 there
    (their q and dO read as zeros)."""
    offs_m = (lo + j) * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_s)
    lse = gl.load(LSE + row_base + offs_m, mask=offs_m < Lq, other=float("inf"))
    delta = gl.load(DELTA + row_base + offs_m, mask=offs_m < Lq, other=0.0)
    return offs_m, lse, delta


@gluon.jit
def _issue_scores(k, v, q_smem, do_smem, q_ready, j, s_zero, HEAD_DIM: gl.constexpr,
                  BLOCK_M: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Block j's q and dO slots once loaded, and S^T = K Q^T, dP^T = V dO^T issued (not
    waited)."""
    s = j % STAGES
    mbarrier.wait(q_ready.index(s), (j // STAGES) & 1)
    q = q_smem.index(s).reshape([BLOCK_M, HEAD_DIM])
    do = do_smem.index(s).reshape([BLOCK_M, HEAD_DIM])
    s_t = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp_t = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return q, do, s_t, dp_t


@gluon.jit
def _probs(s_t, offs_m, lse, offs_n, key0, block_row0, qk_scale, Lk, IS_CAUSAL: gl.constexpr):
    """P^T of one query block from S^T."""
    p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse * LOG2E, 0))
    if key0 + HALF_N > Lk:  # keys past Lk (zero-filled): P = 0, as dq reads dS there
        p_t = gl.where(gl.expand_dims(offs_n < Lk, 1), p_t, 0.0)
    # causal: key j is seen by queries i >= j only; only the blocks that cross the diagonal
    # pay for the select
    if IS_CAUSAL and block_row0 < key0 + HALF_N - 1:
        keep = gl.expand_dims(offs_n, 1) <= gl.expand_dims(offs_m, 0)
        p_t = gl.where(keep, p_t, 0.0)
    return p_t


@gluon.jit
def _dkdv_overlapped(k, v, q_smem, do_smem, q_ready, q_empty, dk, dv, s_zero, LSE, DELTA,
                     row_base, offs_n, key0, lo, n_m, qk_scale, Lq, Lk, HEAD_DIM: gl.constexpr,
                     BLOCK_M: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                     col_s: gl.constexpr, a_layout: gl.constexpr):  # fmt: skip
    """The query loop in the order of the forward's OVERLAP (FlashAttention-3, sec. 3.2):
    block j's S^T and dP^T are issued before block j-1's dV and dK products, so block j's
    P^T and dS^T are formed while the tensor cores run those. Needs n_m >= 1 and STAGES >= 2
    (a q/dO slot is released one block later than in the plain loop)."""
    gl.static_assert(STAGES >= 2, "OVERLAP holds two blocks' q/dO slots at once")
    dtype: gl.constexpr = q_smem.dtype
    offs_m, lse, delta = _row_stats(LSE, DELTA, row_base, 0, lo, Lq, BLOCK_M, col_s)
    q, do, s_t, dp_t = _issue_scores(k, v, q_smem, do_smem, q_ready, 0, s_zero, HEAD_DIM,
                                     BLOCK_M, STAGES)  # fmt: skip
    s_t, dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, dp_t))
    p_t = _probs(s_t, offs_m, lse, offs_n, key0, lo * BLOCK_M, qk_scale, Lk, IS_CAUSAL)
    ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
    p_op = gl.convert_layout(p_t.to(dtype), a_layout)
    ds_op = gl.convert_layout(ds_t.to(dtype), a_layout)
    for j in range(1, n_m):
        prev = (j - 1) % STAGES
        offs_m, lse, delta = _row_stats(LSE, DELTA, row_base, j, lo, Lq, BLOCK_M, col_s)
        q, do, s_t, dp_t = _issue_scores(k, v, q_smem, do_smem, q_ready, j, s_zero, HEAD_DIM,
                                         BLOCK_M, STAGES)  # fmt: skip
        dv = warpgroup_mma(p_op, do_smem.index(prev).reshape([BLOCK_M, HEAD_DIM]), dv,
                           is_async=True)  # fmt: skip
        dk = warpgroup_mma(ds_op, q_smem.index(prev).reshape([BLOCK_M, HEAD_DIM]), dk,
                           is_async=True)  # fmt: skip
        s_t, dp_t = warpgroup_mma_wait(num_outstanding=2, deps=(s_t, dp_t))
        p_t = _probs(s_t, offs_m, lse, offs_n, key0, (lo + j) * BLOCK_M, qk_scale, Lk,
                     IS_CAUSAL)  # fmt: skip
        ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        mbarrier.arrive(q_empty.index(prev), count=1)
        p_op = gl.convert_layout(p_t.to(dtype), a_layout)
        ds_op = gl.convert_layout(ds_t.to(dtype), a_layout)
    last = (n_m - 1) % STAGES
    dv = warpgroup_mma(p_op, do_smem.index(last).reshape([BLOCK_M, HEAD_DIM]), dv, is_async=True)
    dk = warpgroup_mma(ds_op, q_smem.index(last).reshape([BLOCK_M, HEAD_DIM]), dk, is_async=True)
    dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
    mbarrier.arrive(q_empty.index(last), count=1)
    return dk, dv


@gluon.jit
def _dq_product(buf, k_smem, dq_zero, half: gl.constexpr, HEAD_DIM: gl.constexpr):
    """dq = dS K over both consumers' keys (issued, not waited)."""
    dq = dq_zero
    for c in gl.static_range(2):  # each consumer's keys: dS[:, keys of c] K[keys of c]
        ds_c = buf.slice(c * half, half).permute((1, 0))
        k_c = k_smem.index(c).reshape([half, HEAD_DIM])
        dq = warpgroup_mma(ds_c, k_c, dq, use_acc=c > 0, is_async=True)
    return dq


@gluon.jit
def _shared_dq(ds_t, ds_smem, ds_ready, k_smem, q_empty, dq_desc, dv, dk, dq_zero, j, s, dq_row,
               C: gl.constexpr, HEAD_DIM: gl.constexpr, COMPUTES: gl.constexpr):  # fmt: skip
    """DQ_SHARED(_C0) for block j (q/dO slot s), dV and dK's products in flight: this
    consumer's dS^T into buffer j % 2; with COMPUTES it then forms dq = dS K over both
    consumers' 128 keys and adds it at dq_row. ds_ready completes once a block (both
    arrivals); waiting for block j - 1's before writing keeps the consumers within a block
    of each other, so a buffer is rewritten only once block j - 2's dq product has read it.
    COMPUTES is compile-time (the caller unrolls blocks in pairs): a runtime branch could not
    leave dV's and dK's products in flight behind dq's on one side only."""
    half: gl.constexpr = ds_t.shape[0]
    mbarrier.wait(ds_ready, (j - 1) & 1)  # at j = 0 parity 1: a fresh barrier passes
    buf = ds_smem.index(j % 2)
    buf.slice(C * half, half).store(ds_t.to(ds_smem.dtype))
    fence_async_shared()
    mbarrier.arrive(ds_ready, count=1)
    if COMPUTES:
        mbarrier.wait(ds_ready, j & 1)
        dq = _dq_product(buf, k_smem, dq_zero, half, HEAD_DIM)
        # dq's two products (commit groups) read neither q nor dO: the slot goes once dV's
        # and dK's are done
        dv, dk = warpgroup_mma_wait(num_outstanding=2, deps=(dv, dk))
        mbarrier.arrive(q_empty.index(s), count=1)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        _tma_reduce_add(dq_desc, [dq_row, 0], dq)
    else:
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        mbarrier.arrive(q_empty.index(s), count=1)
    return dv, dk


@gluon.jit
def _dq_partition(args, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    """DQ_WG: per query block, once both consumers' dS^T halves are in buffer j % NB_DS,
    dq = dS K over the 128 keys, the buffer released, dq added at its rows by a TMA
    reduction."""
    (ds_smem, k_smem, kv_bar, ds_full, ds_empty, dq_desc, dq_row0, lo, n_m) = args
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    mbarrier.wait(kv_bar, 0)
    for j in range(n_m):
        b = j % NB_DS
        mbarrier.wait(ds_full.index(b), (j // NB_DS) & 1)
        dq = _dq_product(ds_smem.index(b), k_smem, dq_zero, HALF_N, HEAD_DIM)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        mbarrier.arrive(ds_empty.index(b), count=1)
        if ABLATE != 1:
            _tma_reduce_add(dq_desc, [dq_row0 + (lo + j) * BLOCK_M, 0], dq)
        elif dq_row0 < 0:  # never: keeps dq's products alive without the reduction
            _tma_reduce_add(dq_desc, [0, 0], dq)


@gluon.jit
def _block_products(k, v, q_smem, do_smem, q_ready, dv, dk, s_zero, LSE, DELTA, row_base, offs_n,
                    key0, lo, j, qk_scale, Lq, Lk, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                    STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, col_s: gl.constexpr,
                    a_layout: gl.constexpr):  # fmt: skip
    """Block j of the plain loop up to dV's and dK's products, issued (in flight): returns
    dS^T, dv and dk."""
    dtype: gl.constexpr = q_smem.dtype
    offs_m, lse, delta = _row_stats(LSE, DELTA, row_base, j, lo, Lq, BLOCK_M, col_s)
    q, do, s_t, dp_t = _issue_scores(k, v, q_smem, do_smem, q_ready, j, s_zero, HEAD_DIM,
                                     BLOCK_M, STAGES)  # fmt: skip
    s_t, dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, dp_t))
    p_t = _probs(s_t, offs_m, lse, offs_n, key0, (lo + j) * BLOCK_M, qk_scale, Lk, IS_CAUSAL)
    # dV's product is issued first, so dS^T is formed while the tensor cores run it
    p_op = gl.convert_layout(p_t.to(dtype), a_layout)
    dv = warpgroup_mma(p_op, do, dv, is_async=True)
    ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
    ds_op = gl.convert_layout(ds_t.to(dtype), a_layout)
    dk = warpgroup_mma(ds_op, q, dk, is_async=True)
    return ds_t, dv, dk


@gluon.jit
def _shared_block(k, v, q_smem, do_smem, q_ready, q_empty, ds_smem, ds_ready, k_smem, dq_desc,
                  dv, dk, s_zero, dq_zero, LSE, DELTA, row_base, offs_n, key0, lo, j, dq_row0,
                  qk_scale, Lq, Lk, C: gl.constexpr, HEAD_DIM: gl.constexpr,
                  BLOCK_M: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                  col_s: gl.constexpr, a_layout: gl.constexpr,
                  COMPUTES: gl.constexpr):  # fmt: skip
    """Block j with DQ_SHARED(_C0): the plain loop's products, then _shared_dq."""
    ds_t, dv, dk = _block_products(k, v, q_smem, do_smem, q_ready, dv, dk, s_zero, LSE, DELTA,
                                   row_base, offs_n, key0, lo, j, qk_scale, Lq, Lk, HEAD_DIM,
                                   BLOCK_M, STAGES, IS_CAUSAL, col_s, a_layout)  # fmt: skip
    return _shared_dq(ds_t, ds_smem, ds_ready, k_smem, q_empty, dq_desc, dv, dk, dq_zero, j,
                      j % STAGES, dq_row0 + (lo + j) * BLOCK_M, C, HEAD_DIM, COMPUTES)  # fmt: skip


@gluon.jit
def _dkdv_partition(args, C: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                    STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, DQ: gl.constexpr,
                    OVERLAP: gl.constexpr):  # fmt: skip
    """Consumer C: keys start_n + C * 64 ... + 63; dk (scaled) and dv stored at the end; with
    DQ, also this block's dS K added into DQ_ACC (float32, unscaled): by element atomics
    (DQ_ATOMIC, which alone reads DQ_ACC and the q strides) or by TMA reductions through
    dq_desc at row dq_row0 + the block's (DQ_TMA, DQ_SHARED, DQ_SHARED_C0); OVERLAP: the
    loop of _dkdv_overlapped (without DQ)."""
    (q_smem, k_smem, v_smem, do_smem, ds_smem, kv_bar, ds_ready, ds_full, ds_empty, q_ready,
     q_empty, LSE, DELTA, DK, DV, DQ_ACC, dq_desc, dq_row0, stride_lb, stride_lh, stride_kb,
     stride_kh, stride_kn, stride_qb, stride_qh, stride_qm, off_b, off_h, start_n, lo, n_m,
     scale, Lq, Lk) = args  # fmt: skip
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
    row_base = off_b * stride_lb + off_h * stride_lh
    if DQ:
        dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    if DQ == DQ_ATOMIC:
        dq_cols = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout)), 0)
        dq_base = off_b * stride_qb + off_h * stride_qh

    mbarrier.wait(kv_bar, 0)
    k = k_smem.index(C).reshape([HALF_N, HEAD_DIM])
    v = v_smem.index(C).reshape([HALF_N, HEAD_DIM])
    if OVERLAP:
        gl.static_assert(not DQ, "OVERLAP is for dK/dV only")
        dk, dv = _dkdv_overlapped(k, v, q_smem, do_smem, q_ready, q_empty, dk, dv, s_zero, LSE,
                                  DELTA, row_base, offs_n, key0, lo, n_m, qk_scale, Lq, Lk,
                                  HEAD_DIM, BLOCK_M, STAGES, IS_CAUSAL, col_s,
                                  a_layout)  # fmt: skip
    elif DQ == DQ_WG:  # dS^T handed to the dq partition
        for j in range(n_m):
            ds_t, dv, dk = _block_products(k, v, q_smem, do_smem, q_ready, dv, dk, s_zero, LSE,
                                           DELTA, row_base, offs_n, key0, lo, j, qk_scale, Lq,
                                           Lk, HEAD_DIM, BLOCK_M, STAGES, IS_CAUSAL, col_s,
                                           a_layout)  # fmt: skip
            b = j % NB_DS
            mbarrier.wait(ds_empty.index(b), ((j // NB_DS) & 1) ^ 1)  # fresh: passes
            ds_smem.index(b).slice(C * HALF_N, HALF_N).store(ds_t.to(dtype))
            fence_async_shared()
            mbarrier.arrive(ds_full.index(b), count=1)
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
            mbarrier.arrive(q_empty.index(j % STAGES), count=1)
    elif DQ >= DQ_SHARED:  # blocks in pairs: which consumer forms dq is compile-time
        first: gl.constexpr = C == 0
        second: gl.constexpr = C == (0 if DQ == DQ_SHARED_C0 else 1)
        for jj in range(0, n_m, 2):
            dv, dk = _shared_block(k, v, q_smem, do_smem, q_ready, q_empty, ds_smem, ds_ready,
                                   k_smem, dq_desc, dv, dk, s_zero, dq_zero, LSE, DELTA,
                                   row_base, offs_n, key0, lo, jj, dq_row0, qk_scale, Lq, Lk, C,
                                   HEAD_DIM, BLOCK_M, STAGES, IS_CAUSAL, col_s, a_layout,
                                   first)  # fmt: skip
            if jj + 1 < n_m:
                dv, dk = _shared_block(k, v, q_smem, do_smem, q_ready, q_empty, ds_smem,
                                       ds_ready, k_smem, dq_desc, dv, dk, s_zero, dq_zero, LSE,
                                       DELTA, row_base, offs_n, key0, lo, jj + 1, dq_row0,
                                       qk_scale, Lq, Lk, C, HEAD_DIM, BLOCK_M, STAGES, IS_CAUSAL,
                                       col_s, a_layout, second)  # fmt: skip
    else:
        for j in range(n_m):
            s = j % STAGES
            ds_t, dv, dk = _block_products(k, v, q_smem, do_smem, q_ready, dv, dk, s_zero, LSE,
                                           DELTA, row_base, offs_n, key0, lo, j, qk_scale, Lq,
                                           Lk, HEAD_DIM, BLOCK_M, STAGES, IS_CAUSAL, col_s,
                                           a_layout)  # fmt: skip
            if DQ:  # dS (this block's rows) K: dS^T through shared memory, read transposed
                ds_slot = ds_smem.index(C)
                ds_slot.store(ds_t.to(dtype))
                fence_async_shared()
                dq = warpgroup_mma(ds_slot.permute((1, 0)), k, dq_zero, use_acc=False,
                                   is_async=True)  # fmt: skip
                dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
                mbarrier.arrive(q_empty.index(s), count=1)
                if DQ == DQ_TMA:
                    # dq_desc spans every (batch, head)'s rows: those past Lq add this
                    # block's zeros (P = 0 there) into the next head's first rows
                    _tma_reduce_add(dq_desc, [dq_row0 + (lo + j) * BLOCK_M, 0], dq)
                else:
                    rows_q = (lo + j) * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_o)
                    dq_ptrs = DQ_ACC + dq_base + gl.expand_dims(rows_q, 1) * stride_qm + dq_cols
                    gl.atomic_add(dq_ptrs, dq, mask=gl.expand_dims(rows_q < Lq, 1),
                                  sem="relaxed")  # fmt: skip
            else:
                dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
                mbarrier.arrive(q_empty.index(s), count=1)

    rows = key0 + gl.arange(0, HALF_N, layout=row_o)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    offs = gl.expand_dims(rows, 1) * stride_kn + gl.expand_dims(cols, 0)
    base = off_b * stride_kb + off_h * stride_kh
    keep_rows = gl.expand_dims(rows < Lk, 1)
    gl.store(DK + base + offs, (dk * scale).to(dtype), mask=keep_rows)
    gl.store(DV + base + offs, dv.to(dtype), mask=keep_rows)


@gluon.jit
def attn_bwd_dkdv_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, LSE, DELTA, DK, DV,
                                DQ_ACC, stride_lb, stride_lh, stride_kb, stride_kh, stride_kn,
                                stride_qb, stride_qh, stride_qm, scale, H, Lq, Lk,
                                HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                                STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                                DQ: gl.constexpr, OVERLAP: gl.constexpr):  # fmt: skip
    """dk, dv (and with DQ their programs' shares of dq) of 128 keys of one (batch, head); see
    the module docstring. Descriptors are rank 4 over (B, H, L, E): q and do in blocks of
    BLOCK_M rows, k and v of 64; dq_desc (DQ >= DQ_TMA) rank 2 over DQ_ACC as (B H Lq, E)."""
    start_n = gl.program_id(0) * 2 * HALF_N
    off_bh = gl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    lo = 0
    if IS_CAUSAL:  # the first query block that sees one of these keys
        lo = start_n // BLOCK_M
    n_m = gl.cdiv(Lq, BLOCK_M) - lo

    dtype: gl.constexpr = q_desc.dtype
    q_shape: gl.constexpr = [STAGES] + q_desc.block_type.shape
    kv_shape: gl.constexpr = [2] + k_desc.block_type.shape
    q_smem = gl.allocate_shared_memory(dtype, q_shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, q_shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, kv_shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, kv_shape, v_desc.layout)
    ds_smem = q_smem  # without DQ a placeholder, never read (DQ is compile-time)
    if DQ >= DQ_SHARED:  # two buffers of both consumers' dS^T (NB_DS with DQ_WG)
        ds_layout_2: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                         element_bitwidth=16)  # fmt: skip
        ds_smem = gl.allocate_shared_memory(dtype, [2, 2 * HALF_N, BLOCK_M], ds_layout_2)
    elif DQ:  # one dS^T slot a consumer; BLOCK_M 64 bf16 columns: 128-byte rows
        ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                       element_bitwidth=16)  # fmt: skip
        ds_smem = gl.allocate_shared_memory(dtype, [2, HALF_N, BLOCK_M], ds_layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    ds_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)  # used by DQ_SHARED(_C0) only
    ds_full = gl.allocate_shared_memory(gl.int64, [NB_DS, 1], bar_layout)  # DQ_WG only
    ds_empty = gl.allocate_shared_memory(gl.int64, [NB_DS, 1], bar_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(ds_ready, count=2)  # one arrival per consumer
    for b in gl.static_range(NB_DS):
        mbarrier.init(ds_full.index(b), count=2)  # one arrival per consumer
        mbarrier.init(ds_empty.index(b), count=1)  # the dq partition's
    for s in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(q_empty.index(s), count=2)  # one arrival per consumer

    args = (q_smem, k_smem, v_smem, do_smem, ds_smem, kv_bar, ds_ready, ds_full, ds_empty,
            q_ready, q_empty, LSE, DELTA, DK, DV, DQ_ACC, dq_desc, off_bh * Lq, stride_lb,
            stride_lh, stride_kb, stride_kh, stride_kn, stride_qb, stride_qh, stride_qm, off_b,
            off_h, start_n, lo, n_m, scale, Lq, Lk)  # fmt: skip
    load_args = (q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem, kv_bar,
                 q_ready, q_empty, off_b, off_h, start_n, lo, n_m)  # fmt: skip
    if DQ == DQ_WG:
        dq_args = (ds_smem, k_smem, kv_bar, ds_full, ds_empty, dq_desc, off_bh * Lq, lo, n_m)
        gl.warp_specialize(
            [
                (_dkdv_partition, (args, 0, HEAD_DIM, BLOCK_M, STAGES, IS_CAUSAL, DQ, OVERLAP)),
                (_dkdv_partition, (args, 1, HEAD_DIM, BLOCK_M, STAGES, IS_CAUSAL, DQ, OVERLAP)),
                (_load_partition, (load_args, BLOCK_M, STAGES)),
                (_dq_partition, (dq_args, HEAD_DIM, BLOCK_M)),
            ],
            [4, 1, 4],
            [WG_REGS[0], 24, WG_REGS[1]],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_dkdv_partition, (args, 0, HEAD_DIM, BLOCK_M, STAGES, IS_CAUSAL, DQ, OVERLAP)),
                (_dkdv_partition, (args, 1, HEAD_DIM, BLOCK_M, STAGES, IS_CAUSAL, DQ, OVERLAP)),
                (_load_partition, (load_args, BLOCK_M, STAGES)),
            ],
            [4, 1],
            [240, 24],
        )  # fmt: skip


# (HEAD_DIM, BLOCK_M, STAGES, DQ, OVERLAP); E=128 at BLOCK_M 64 spills 144-160 bytes.
# DQ (E=64 only: dq's product needs 64 query rows a warpgroup; 0: none).
# On an H100 (results/2026-12-07-h100-gluon-bwd-dkdv-80271b7.md, -6758e8f.md) the plain
# loop ran 0.93-1.10x our dK/dV kernel's speed at either stage count, DQ_ATOMIC 0.59-0.67x
# dK/dV + dQ; OVERLAP 0.85-0.96x at E=64, 0.75-0.92x at E=128 (which spills causal).
# DQ_TMA 0.75-0.88x, DQ_SHARED with a runtime branch (dV/dK waited before dq's product)
# 0.88-0.96x (-dqtma-bc714fd.md, -dqshared-bc714fd.md). Not yet run: DQ_SHARED in pairs
# (the branch compile-time) and DQ_SHARED_C0; both spill 32-144 bytes at 2 stages, none at 3.
VARIANTS = [(64, 64, 2, 0, False), (64, 64, 2, 0, True), (64, 64, 3, 0, True),
            (128, 32, 2, 0, False), (128, 32, 2, 0, True),
            (64, 64, 2, DQ_ATOMIC.value, False), (64, 64, 2, DQ_TMA.value, False),
            (64, 64, 3, DQ_TMA.value, False), (64, 64, 3, DQ_SHARED.value, False),
            (64, 64, 3, DQ_SHARED_C0.value, False), (64, 64, 2, DQ_WG.value, False),
            (64, 64, 3, DQ_WG.value, False)]  # fmt: skip


def _dq_descriptor(dq_acc, block_m: int):
    """A rank-2 TMA descriptor over the float32 dq accumulator as (B H Lq, E), blocks of
    block_m rows: the TMA reduction's target."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    flat = dq_acc.view(-1, dq_acc.shape[-1])
    block = [block_m, flat.shape[1]]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float32)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), block, layout)


def dkdv(q, k, v, do, lse, delta, scale, causal, variant, poison=False):
    """dk, dv (and dq with the variant's DQ, else None) by the Gluon kernel; (B, H, L, E)
    contiguous fp16/bf16, lse and delta (B, H, L) float32. ``poison``: dk and dv start as
    NaN."""
    from flash_jvp._ops import _cdiv, _descriptor

    E, block_m, stages, dq, overlap = variant
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    # one set of strides for both (contiguous); NaN where a row might stay unwritten
    dk, dv = (torch.full(x.shape, float("nan") if poison else 0.0, device=x.device,
                         dtype=x.dtype) for x in (k, v))  # fmt: skip
    dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if dq else lse
    descs = [_descriptor(q, block_m), _descriptor(k, 64), _descriptor(v, 64),
             _descriptor(do, block_m)]  # fmt: skip
    # without a TMA mode (DQ >= DQ_TMA) q's descriptor stands in, never read
    tma_dq = dq >= DQ_TMA.value
    descs.append(_dq_descriptor(dq_acc, block_m) if tma_dq else descs[0])
    grid = (_cdiv(Lk, 128), B * H)
    attn_bwd_dkdv_hopper_kernel[grid](
        *descs, lse, delta, dk, dv, dq_acc, lse.stride(0), lse.stride(1), *dk.stride()[:3],
        *(dq_acc.stride()[:3] if dq else (0, 0, 0)), scale, H, Lq, Lk, HEAD_DIM=E,
        BLOCK_M=block_m, STAGES=stages, IS_CAUSAL=causal, DQ=dq, OVERLAP=overlap, num_warps=4,
    )  # fmt: skip
    return dk, dv, (dq_acc * scale).to(q.dtype) if dq else None


def _inputs(B, H, L, E, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return [torch.randn(B, H, L, E, device="cuda", dtype=dtype) for _ in range(4)]


def _stats(q, k, v, do, causal):
    import flash_jvp

    o, lse = flash_jvp.attention_with_lse(q, k, v, is_causal=causal)
    delta = (o.float() * do.float()).sum(-1)
    return lse.contiguous(), delta.contiguous()


POINTERS = {"LSE": "*fp32", "DELTA": "*fp32", "DK": "*bf16", "DV": "*bf16", "DQ_ACC": "*fp32",
            "scale": "fp32"}  # fmt: skip


def compile_report() -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import compile_sm90
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.experimental.gluon._runtime import GluonASTSource

    from flash_jvp._ops import _descriptor

    for E, block_m, stages, dq, overlap in VARIANTS:
        x = torch.empty(2, 4, 1024, E, dtype=torch.bfloat16)
        descs = dict(q_desc=_descriptor(x, block_m), k_desc=_descriptor(x, 64),
                     v_desc=_descriptor(x, 64), do_desc=_descriptor(x, block_m))  # fmt: skip
        tma_dq = dq >= DQ_TMA.value
        descs["dq_desc"] = _dq_descriptor(x.float(), block_m) if tma_dq else descs["q_desc"]
        for causal in (False, True):
            sig = {}
            for p in attn_bwd_dkdv_hopper_kernel.params:
                if p.name in descs:
                    sig[p.name] = native_specialize_impl(BaseBackend, descs[p.name], False, True,
                                                         True)[0]  # fmt: skip
                elif p.is_constexpr:
                    sig[p.name] = "constexpr"
                else:
                    sig[p.name] = POINTERS.get(p.name, "i32")
            consts = dict(HEAD_DIM=E, BLOCK_M=block_m, STAGES=stages, IS_CAUSAL=causal, DQ=dq,
                          OVERLAP=overlap)  # fmt: skip
            res = compile_sm90._compile_report(attn_bwd_dkdv_hopper_kernel, sig, consts, {},
                                               {"num_warps": 4}, GluonASTSource)  # fmt: skip
            print(f"E{E:3d} BLOCK_M {block_m:3d} stages {stages} dq {dq!s:5} overlap "
                  f"{overlap!s:5} causal {causal!s:5}: {res}")  # fmt: skip
    return 0


def _grads(q, k, v, do, causal, dtype=None):
    """dq, dk, dv: in float64 through torch's math attention (``dtype`` float64), else
    flash_jvp's in the inputs' dtype."""
    import flash_jvp

    q, k, v = (x.to(dtype or x.dtype).requires_grad_() for x in (q, k, v))
    f = torch.nn.functional.scaled_dot_product_attention if dtype else flash_jvp.attention
    o = f(q, k, v, is_causal=causal)
    return torch.autograd.grad(o, (q, k, v), do.to(o.dtype))


def _rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def run_check() -> int:
    """dk, dv (and dq) of every variant against float64, beside our Triton backward's error in
    the same dtype (the bar: 2x that + 4e-3, as tests/helpers.py's bf16 tolerance); dk and dv
    start as NaN, so an unwritten row fails (dq's sum starts at 0 for the atomics: a missing
    share shows only as error)."""
    ok = True
    for variant in VARIANTS:
        E, with_dq = variant[0], variant[3]
        for L, causal in ((1000, False), (1024, True), (777, True), (2048, False), (64, True)):
            q, k, v, do = _inputs(2, 4, L, E)
            lse, delta = _stats(q, k, v, do, causal)
            dk, dv, dq = dkdv(q, k, v, do, lse, delta, E**-0.5, causal, variant, poison=True)
            ref = _grads(q, k, v, do, causal, torch.float64)
            ours = _grads(q, k, v, do, causal)
            first = 0 if with_dq else 1  # dq is checked only where the kernel gives it
            names, ref, ours = ("dq", "dk", "dv")[first:], ref[first:], ours[first:]
            errs = [_rel(x, r) for x, r in zip((dq, dk, dv)[first:], ref)]
            bars = [2 * _rel(x, r) + 4e-3 for x, r in zip(ours, ref)]
            good = all(e <= b for e, b in zip(errs, bars))
            ok &= good
            cells = " ".join(f"{n} {e:.1e} (bar {b:.1e})" for n, e, b in zip(names, errs, bars))
            print(f"{variant} L{L} causal {causal}: {cells} {'pass' if good else 'FAIL'}",
                  flush=True)  # fmt: skip
    return 0 if ok else 1


def _triton_bwd_ms(q, k, v, do, causal) -> tuple[float, float]:
    """Our Triton dK/dV and dQ kernels' times inside flash_jvp's backward (bwd_kernels.py's
    profile, mean of 10 runs)."""
    from bwd_kernels import kernel_times

    import flash_jvp

    rows = kernel_times(functools.partial(flash_jvp.attention, is_causal=causal), q, k, v, do)
    return tuple(sum(ms for key, ms, _ in rows if name in key) for name in ("bwd_dkdv", "bwd_dq"))


def run_time(out: str | None) -> int:
    from triton.testing import do_bench

    # with DQ the Gluon kernel replaces both Triton kernels: its time (with dq's zero fill and
    # final scale, the cost of the design) against their sum. do_bench clears L2 between
    # runs, the profiled Triton runs go back to back: a small bias in Triton's favour.
    head = (
        "| E | L | causal | BLOCK_M | stages | dq | overlap | gluon ms | triton dK/dV ms "
        "| triton dQ ms | triton / gluon |"
    )
    rows, lines = [], [head, "|---" * 11 + "|"]
    for variant in VARIANTS:
        E, block_m, stages, with_dq, overlap = variant
        H = 16 if E == 64 else 8
        for L in (4096, 8192):
            for causal in (False, True):
                q, k, v, do = _inputs(4, H, L, E)
                lse, delta = _stats(q, k, v, do, causal)
                ms = do_bench(functools.partial(dkdv, q, k, v, do, lse, delta, E**-0.5, causal,
                                                variant))  # fmt: skip
                dkdv_ms, dq_ms = _triton_bwd_ms(q, k, v, do, causal)
                ref = dkdv_ms + (dq_ms if with_dq else 0.0)
                rows.append(dict(E=E, L=L, causal=causal, BLOCK_M=block_m, stages=stages,
                                 dq=with_dq, overlap=overlap, gluon_ms=ms,
                                 triton_dkdv_ms=dkdv_ms, triton_dq_ms=dq_ms))  # fmt: skip
                cells = (E, L, causal, block_m, stages, with_dq, overlap, f"{ms:.3f}",
                         f"{dkdv_ms:.3f}", f"{dq_ms:.3f}", f"{ref / ms:.3f}")  # fmt: skip
                lines.append("| " + " | ".join(map(str, cells)) + " |")
                print(lines[-1], flush=True)
    if out:
        write_results(out, "gluon-bwd-dkdv", "Gluon dK/dV vs Triton dK/dV", rows, lines)
    return 0


def write_results(out: str, name: str, title: str, rows: list, lines: list) -> None:
    """``out``/<date>-<name>.json (the rows) and .md (the table), with the environment."""
    from flash_jvp._env import environment

    env = environment()
    stem = os.path.join(out, f"{dt.date.today()}-{name}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(environment=env, rows=rows), f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(f"# {title}\n\n{json.dumps(env)}\n\n" + "\n".join(lines) + "\n")


def cli(doc: str, compile_report, run_check, run_time) -> int:
    """The prototypes' command line: compile | check | time [--out DIR]."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("mode", choices=["compile", "check", "time"])
    parser.add_argument("--out", default=None, help="folder for the time mode's .json/.md")
    args = parser.parse_args()
    if args.mode == "compile":
        return compile_report()
    if args.mode == "check":
        return run_check()
    return run_time(args.out)


if __name__ == "__main__":
    sys.exit(cli(__doc__, compile_report, run_check, run_time))
