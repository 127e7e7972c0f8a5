"""kernels/ws_barriers.py: which barriers of a warp-specialised TTGIR are unused, and that
removing them removes nothing else (CPU; the compiled kernels are checked on sm_90 PTX by
benchmarks/NOTES.md's recipe, the effect on the GPU by benchmarks/ws_race.py)."""

from flash_jvp.kernels import ws_barriers

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
