"""kernels/ws_barriers.py: which barriers of a warp-specialised TTGIR are unused, and that
removing them removes nothing else (CPU; the compiled kernels are checked on sm_90 PTX by
benchmarks/NOTES.md's recipe, the effect on the GPU by benchmarks/ws_race.py)."""

import pytest
import torch
from helpers import CUDA

import flash_jvp
from flash_jvp.kernels import configs, ws_barriers
from flash_jvp.kernels.fwd import attn_fwd_kernel

# The shape of Triton 3.6's output: %0 a TMA barrier the partitions use, %3 made and
# initialised only, %6 one whose view the default partition waits on.
TTGIR = """\
    %0 = ttg.local_alloc : () -> !ttg.memdesc<2x1xi64, #shared, #smem, mutable> loc(#loc)
    %1 = ttg.memdesc_index %0[%c0_i32] : !ttg.memdesc<2x1xi64> -> !ttg.memdesc<1xi64>
    ttng.init_barrier %1, 1 : !ttg.memdesc<1xi64, #shared, #smem, mutable> loc(#loc)
    %3 = ttg.local_alloc : () -> !ttg.memdesc<1x1xi64, #shared, #smem, mutable> loc(#loc)
    %4 = ttg.memdesc_index %3[%c0_i32] : !ttg.memdesc<1x1xi64> -> !ttg.memdesc<1xi64>
    ttng.init_barrier %4, 1 : !ttg.memdesc<1xi64, #shared, #smem, mutable> loc(#loc)
    %6 = ttg.local_alloc : () -> !ttg.memdesc<1x1xi64, #shared, #smem, mutable> loc(#loc)
    %7 = ttg.memdesc_index %6[%c0_i32] : !ttg.memdesc<1x1xi64> -> !ttg.memdesc<1xi64>
    ttng.init_barrier %7, 128 : !ttg.memdesc<1xi64, #shared, #smem, mutable> loc(#loc)
    ttng.wait_barrier %7, %c1_i32 : !ttg.memdesc<1xi64, #shared, #smem, mutable> loc(#loc)
    %8 = ttg.local_alloc : () -> !ttg.memdesc<2x128x64xbf16, #shared1, #smem, mutable>
    ttg.warp_specialize(%0, %8) attributes {requestedRegisters = array<i32: 232>}
    partition0(%arg0: !ttg.memdesc<2x1xi64>, %arg1: !ttg.memdesc<2x128x64xbf16>) num_warps(4) {
      %9 = ttg.memdesc_index %arg0[%c0_i32] : !ttg.memdesc<2x1xi64> -> !ttg.memdesc<1xi64>
      ttng.wait_barrier %9, %c0_i32 : !ttg.memdesc<1xi64, #shared, #smem, mutable>
      ttg.warp_return
    }
"""


def test_finds_only_the_barrier_nothing_reads():
    assert ws_barriers.dead_barriers(TTGIR) == ["%3"]


def test_a_name_read_inside_a_partition_keeps_the_barrier():
    # partitions are isolated regions and may reuse names: a read of the name anywhere
    # keeps it (the partition's lines are never removed either)
    shadowed = TTGIR.replace("%9", "%4")
    assert ws_barriers.dead_barriers(shadowed) == []
    assert ws_barriers.remove_dead_barriers(shadowed) == shadowed


def test_removes_its_alloc_view_and_init_and_nothing_else():
    fixed = ws_barriers.remove_dead_barriers(TTGIR)
    removed = [line for line in TTGIR.splitlines() if line not in fixed.splitlines()]
    assert removed == TTGIR.splitlines()[3:6]
    assert ws_barriers.dead_barriers(fixed) == []
    assert "%9 = ttg.memdesc_index %arg0" in fixed


def test_a_barrier_passed_to_the_partitions_is_kept():
    # %0 reaches the warp_specialize op (after an '=' inside its attributes)
    assert "%0" not in ws_barriers.dead_barriers(TTGIR)


def test_reinitialised_offsets():
    lines = [
        "mov.b32 %r10, global_smem;",
        "add.s32 %r11, %r10, 181120;",
        "add.s32 %r12, %r10, 8;",
        "@%p1 mbarrier.init.shared::cta.b64 [%r10], 1;",
        "@%p1 mbarrier.init.shared::cta.b64 [%r11], 128;",
        "@%p1 mbarrier.init.shared::cta.b64 [%r12], 1;",
    ]
    assert ws_barriers.reinitialised("\n".join(lines)) == []
    assert ws_barriers.reinitialised("\n".join([*lines, lines[3]])) == [0]
    # invalidated in between, as Triton's own pipelined descriptor loads do: allowed
    inval = "@%p1 mbarrier.inval.shared::cta.b64 [%r10];"
    assert ws_barriers.reinitialised("\n".join([*lines, inval, lines[3]])) == []
    # a register moved after its init (a loop's address step) names a new offset from there
    # on only: its earlier init stays at 8
    step = "add.s32 %r12, %r12, 181112;"
    assert ws_barriers.reinitialised("\n".join([*lines, step])) == []
    assert ws_barriers.reinitialised("\n".join([*lines, step, lines[5]])) == [181120]
    # any other write makes the offset unknown; a copy carries it
    for other in ("add.s32 %r12, %r10, %r40;", "mov.b32 %r12, 0;", "selp.b32 %r12, %r1, %r2, %p3;"):
        assert ws_barriers.reinitialised("\n".join([*lines, other, lines[5]])) == []
    copy = "mov.b32 %r13, %r12;"
    again = "@%p1 mbarrier.init.shared::cta.b64 [%r13], 1;"
    assert ws_barriers.reinitialised("\n".join([*lines, copy, again])) == [8]
    back = "add.s32 %r13, %r11, -181112;"
    assert ws_barriers.reinitialised("\n".join([*lines, back, again])) == [8]


@pytest.mark.gpu
@pytest.mark.skipif(
    not (CUDA and torch.cuda.get_device_capability()[0] == 9 and ws_barriers.AFFECTED),
    reason="Triton < 3.8's warp specialisation on Hopper only",
)
def test_launched_warp_specialised_forward_initialises_each_barrier_once(monkeypatch):
    """The warp-specialised forwards as the launcher compiles them: no shared-memory
    location initialised as an mbarrier twice (Triton 3.6 gives 20 inits on bytes 0-15).
    The Gluon forward (configs.HOPPER, tests/test_hopper.py) is kept out of the way."""
    monkeypatch.setattr(configs, "HOPPER", {})
    assert configs._WARP_SPECIALISED[False].get("fwd+jvp"), "no warp-specialised config"
    q, k, v, q_t, k_t, v_t = (
        torch.randn(1, 2, 1024, E, device="cuda", dtype=torch.bfloat16)
        for E in (64, 64, 64, 64, 64, 64)
    )
    torch.func.jvp(flash_jvp.attention, (q, k, v), (q_t, k_t, v_t))
    compiled = [
        c
        for c in attn_fwd_kernel.device_caches[torch.cuda.current_device()][0].values()
        if "ttg.warp_specialize" in c.asm["ttgir"]
    ]
    assert compiled, "the launch did not warp-specialise"
    for c in compiled:
        assert ws_barriers.reinitialised(c.asm["ptx"]) == []
