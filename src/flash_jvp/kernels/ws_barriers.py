"""Unused mbarriers of Triton < 3.8's Hopper warp specialisation, removed before lowering.

Triton 3.6 and 3.7's Hopper warp specialisation (``tl.range(..., warp_specialize=True)``
fed by tensor descriptors) makes a pair of barriers per channel and, for a descriptor load,
uses only the one its TMA completes: the other is allocated and initialised, never used.
The shared-memory allocator sees it dead after its ``mbarrier.init`` and puts the key ring's
first slot on top of it (in the forward kernels here: 20 ``mbarrier.init`` on bytes 0-15,
then TMA data there), which the PTX ISA leaves undefined: a location holding an mbarrier
must be invalidated (``mbarrier.inval``) before any other use. Triton 3.8 invalidates the
barriers it makes and gives each its own place (PTX of the same kernel compared,
benchmarks/NOTES.md). For older Tritons this removes the unused ones (their alloc, index
and init, nothing else reads them) from the TTGIR before it is lowered, through the
compiler's stage hook, only for the kernels of :func:`compile_hook`'s ``names``.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile

import triton
from triton import knobs
from triton._C.libtriton import ir

# Triton versions whose warp specialisation leaves the unused barriers (3.8 does not)
AFFECTED = tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 8)

_ALLOC = re.compile(
    r"^\s*(%[\w.$-]+) = ttg\.local_alloc\s*(\{[^}]*\})?\s*: \(\) -> !ttg\.memdesc<[0-9x]*xi64,"
)
_VIEW = re.compile(r"^\s*(%[\w.$-]+) = ttg\.memdesc_index (%[\w.$-]+)\[")
_INIT = re.compile(r"^\s*ttng\.init_barrier (%[\w.$-]+),")
_USE = re.compile(r"%[\w.$-]+")
_RESULTS = re.compile(r"^\s*%[\w.$-]+(?::\d+)?(?:, %[\w.$-]+(?::\d+)?)* = ")


def _prologue(lines: list[str]) -> int:
    """Index of the line holding the ``ttg.warp_specialize`` op: the barriers are made before
    it, at the function's top level (names inside its isolated regions may repeat); 0
    without it (nothing to remove)."""
    return next((i for i, line in enumerate(lines) if "ttg.warp_specialize(" in line), 0)


def dead_barriers(text: str) -> list[str]:
    """SSA names of the barrier allocations made before the ``ttg.warp_specialize`` op of
    TTGIR ``text`` that nothing but their own ``ttg.memdesc_index`` views and the
    ``ttng.init_barrier`` of those views reads (a name read anywhere else keeps it)."""
    lines = text.splitlines()
    uses: dict[str, list[str]] = {}
    for line in lines:
        for name in _USE.findall(_RESULTS.sub("", line, count=1)):
            uses.setdefault(name, []).append(line)
    dead = []
    for line in lines[: _prologue(lines)]:
        m = _ALLOC.match(line)
        if not m:
            continue
        alloc = m.group(1)
        views = [_VIEW.match(use) for use in uses.get(alloc, [])]
        ok = all(v and v.group(2) == alloc for v in views)
        views = [v.group(1) for v in views if v] if ok else []
        for view in views:
            ok = ok and all(
                (i := _INIT.match(use)) and i.group(1) == view for use in uses.get(view, [])
            )
        if ok and views:
            dead.append(alloc)
    return dead


def remove_dead_barriers(text: str) -> str:
    """``text`` without the allocations :func:`dead_barriers` finds, their views and inits."""
    dead = set(dead_barriers(text))
    if not dead:
        return text
    lines = text.splitlines()
    end = _prologue(lines)
    views = set()
    keep = []
    for line in lines[:end]:
        m = _ALLOC.match(line)
        if m and m.group(1) in dead:
            continue
        view = _VIEW.match(line)
        if view and view.group(2) in dead:
            views.add(view.group(1))
            continue
        init = _INIT.match(line)
        if init and init.group(1) in views:
            continue
        keep.append(line)
    return "\n".join(keep + lines[end:]) + "\n"


_BARRIER = re.compile(r"mbarrier\.(init|inval)\.shared::cta\.b64 \[(%r\d+)\]")
_WRITE = re.compile(r"^\s*(?:@!?%p\d+\s+)?([\w.:]+)\s+(%r\d+),\s*(.*);", re.M)
_ADDRESS = re.compile(r"(%r\d+|global_smem)(?:,\s*(-?\d+))?")


def reinitialised(ptx: str) -> list[int]:
    """Shared-memory offsets that an ``mbarrier.init`` of ``ptx`` names while, in text order,
    an earlier init there has not been invalidated (``mbarrier.inval``). Offsets of the form
    global_smem + constant, through chains of mov.b32 / add.s32, each register's offset as it
    stands where the init reads it: ptxas-bound PTX reuses registers, so any other write to
    one (an add of a register, a select, a load) makes its offset unknown from there on."""
    offset, live, twice = {}, set(), set()
    for line in ptx.splitlines():
        barrier = _BARRIER.search(line)
        if barrier:
            op, reg = barrier.groups()
            if reg not in offset:
                continue
            if op == "inval":
                live.discard(offset[reg])
            elif offset[reg] in live:
                twice.add(offset[reg])
            else:
                live.add(offset[reg])
            continue
        write = _WRITE.match(line)
        if not write:
            continue
        opcode, dst, operands = write.groups()
        address = _ADDRESS.fullmatch(operands.strip())
        base = None
        if opcode in ("mov.b32", "mov.u32", "add.s32") and address:
            src, const = address.groups()
            base = 0 if src == "global_smem" else offset.get(src)
            # mov takes no constant; add.s32 needs one (a register sum is unknown)
            if base is not None and (const is None) != opcode.startswith("mov"):
                base = None
            elif base is not None:
                base += int(const or 0)
        if base is None:
            offset.pop(dst, None)
        else:
            offset[dst] = base
    return sorted(twice)


def _rewrite(mod):
    """The module, re-parsed without its unused barriers (unchanged if it has none)."""
    text = mod.str()
    if "ttg.warp_specialize" not in text:
        return mod
    fixed = remove_dead_barriers(text)
    if fixed == text:
        return mod
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttgir")
        with open(path, "w") as f:
            f.write(fixed)
        fixed_mod = ir.parse_mlir_module(path, mod.context)
    fixed_mod.context = mod.context  # as Triton's own IR sources carry it (compiler.py)
    return fixed_mod


@contextlib.contextmanager
def compile_hook(names: tuple[str, ...]):
    """While active, kernels named in ``names`` compiled for CUDA lose their unused barriers
    before lowering (where Triton is AFFECTED); any stage hook already set still runs.
    FLASH_JVP_WS_BARRIER_FIX=0 keeps them (issue 25's A/B; Triton's cache key does not see
    the hook, so give each setting its own TRITON_CACHE_DIR)."""
    if not AFFECTED or os.environ.get("FLASH_JVP_WS_BARRIER_FIX", "1") == "0":
        yield
        return
    previous = knobs.runtime.add_stages_inspection_hook

    def hook(backend, stages, options, language, capability):
        if previous is not None:
            previous(backend, stages, options, language, capability)
        if "llir" not in stages:
            return
        make_llir = stages["llir"]

        def llir(src, metadata):
            if src.get_entry_func_name() in names:
                src = _rewrite(src)
            return make_llir(src, metadata)

        stages["llir"] = llir

    knobs.runtime.add_stages_inspection_hook = hook
    try:
        yield
    finally:
        knobs.runtime.add_stages_inspection_hook = previous
