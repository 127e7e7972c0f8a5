"""Launch plans: a launcher call replayed from its tensors' metadata, without the Python that
built its kernel arguments or Triton's per-launch argument binding.

A launcher (``_ops.attn_fwd``, ``_ops.attn_bwd_tangent``) builds about 90 arguments per
kernel (strides, flags, tile sizes, config) and Triton then specialises each of them again
before it launches: on the H200, 128 us of host time for a forward whose launch itself takes
9 us (``benchmarks/results/2026-12-04-h200-host-profile-4944805.txt``). All of that is a
function of metadata: shapes, strides, dtypes, devices and 16-byte alignment of the tensors,
the scalars, the pattern of which tensors share storage, and the global switches the
launchers read. :func:`planned` keys a launcher's calls by exactly that; the first call of a
key runs the launcher and records its allocations and launches (the compiled kernel and its
positional arguments, with the tensors as slots); later calls allocate the same buffers and
launch the same compiled kernels with their own tensors.

A call records only what this module sees: allocations through :func:`empty` / :func:`zeros`
and launches through :func:`launch`. A launcher that does any other tensor work on a path
(an in-place update, a copy) calls :func:`unplannable`, and such calls keep running the
launcher. Likewise a kernel argument that is neither an input nor a recorded allocation (by
data pointer), or a result that is not one of them, leaves the key unplanned. Plans are only
made where Triton compiles (CUDA, not the interpreter).
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
from triton import knobs

from ._utils import INTERPRET, Spec
from .kernels import ws_barriers

Tensor = torch.Tensor

_DIRECT_LAUNCH = triton.__version__.startswith("3.6.")  # see _direct
MAX_PLANS = 4096  # keys kept per launcher; dropped all at once past it (shapes that vary per call)
_UNPLANNED = object()  # a key whose calls run the launcher every time
_local = threading.local()  # the recording in progress on this thread, if any


@dataclass
class _Launch:
    compiled: object  # triton's CompiledKernel
    grid: tuple[int, int, int]
    values: list  # every kernel argument by position; None where a tensor slot is
    slots: tuple[tuple[int, int], ...]  # (position, source) of the tensor arguments
    direct: tuple | None  # (launch, cooperative, pdl, scratch bytes per program): see _direct


@dataclass
class _Plan:
    allocations: tuple[tuple, ...]  # (shape, dtype, zeroed) per buffer, in call order
    launches: tuple[_Launch, ...]
    results: tuple  # per result: None, or the index of its source
    configs: dict  # the launchers' config choices this plan was made under (see _ops._CHOSEN)


class _Recording:
    def __init__(self, inputs: list[Tensor]):
        self.device = inputs[0].device
        self.inputs = inputs
        # data pointer -> source index; sources are the inputs, then the allocations
        # (an empty tensor owns no memory: its pointer may be anything's, so it is no source)
        self.sources: dict[int, int] = {}
        for i, t in reversed(list(enumerate(inputs))):
            if t.numel():
                self.sources[t.data_ptr()] = i
        self.allocations: list[tuple] = []
        self.buffers: list[Tensor] = []
        self.launches: list[_Launch] = []
        self.ok = True

    def allocated(self, t: Tensor, zeroed: bool) -> None:
        if t.numel():
            self.sources[t.data_ptr()] = len(self.inputs) + len(self.buffers)
        self.allocations.append((tuple(t.shape), t.dtype, zeroed))
        self.buffers.append(t)

    def source(self, t: Tensor) -> int | None:
        return self.sources.get(t.data_ptr()) if t.numel() else None

    def launched(self, kernel, grid: tuple[int, ...], kwargs: dict, compiled) -> None:
        if not self.ok:
            return
        device = torch.cuda.current_device()
        if compiled is None or device != self.device.index:
            self.ok = False
            return
        bound = kernel.device_caches[device][4](**kwargs)[0]  # triton's argument binder
        values, slots = list(bound.values()), []
        for i, value in enumerate(values):
            if isinstance(value, Tensor):
                slots.append((i, self.source(value)))
                values[i] = None  # no tensor is kept alive by a plan
        if any(s[1] is None for s in slots):
            self.ok = False
            return
        grid3 = (*grid, 1, 1)[:3]
        self.launches.append(_Launch(compiled, grid3, values, tuple(slots), _direct(compiled)))

    def plan(self, result, configs: dict) -> _Plan | None:
        if not self.ok:
            return None
        if not self.launches and any(r is not None and r.numel() for r in _tuple(result)):
            return None  # results no launch wrote (a stand-in for _ops._launch, e.g.)
        sources = [*self.inputs, *self.buffers]
        results = []
        for r in _tuple(result):
            index = None if r is None else next((i for i, t in enumerate(sources) if t is r), -1)
            if index == -1:
                return None  # a result made outside the recording (a copy, a cast)
            results.append(index)
        return _Plan(tuple(self.allocations), tuple(self.launches), tuple(results), configs)


def _tuple(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def _key(args: tuple, kwargs: dict) -> tuple[tuple, list[Tensor]] | None:
    """The metadata of a launcher call, and its tensors (None: not plannable here). Host time
    matters here (every eager call of a launcher): one pass, each tensor's data pointer read
    once, and C getters where torch's Python wrappers add microseconds (``x.is_cuda`` and
    ``x.get_device()`` make no device object, ``_get_cublas_allow_tf32`` is what
    ``torch.backends.cuda.matmul.allow_tf32`` returns)."""
    key, tensors, ptrs = sorted(kwargs), [], []  # names: which optional arguments were given
    for a in (*args, *(kwargs[n] for n in key)) if kwargs else args:
        if isinstance(a, Tensor):
            a = (a,)
        elif type(a) is Spec:
            key += (a.scale, a.causal_offset, a.max_seqlen_q, a.max_seqlen_k)
            if not a.varlen:
                continue
            a = (a.cu_seqlens_q, a.cu_seqlens_k)  # both set under varlen
        else:
            key.append(a)
            continue
        for x in a:
            if not x.is_cuda:
                return None
            ptr = x.data_ptr()
            tensors.append(x)
            ptrs.append(ptr)
            key.append((x.shape, x.stride(), x.dtype, x.get_device(), ptr % 16))
    if not tensors:
        return None
    key.append(tuple(map(ptrs.index, ptrs)))  # which tensors share a data pointer
    key.append(torch._C._cuda_getDevice())  # the device the kernels are launched on
    key.append(torch._C._get_cublas_allow_tf32())  # fp32 products: IEEE or TF32
    return tuple(key), tensors


def planned(configs: Callable[[], dict]) -> Callable:
    """Decorator of a launcher: calls with the metadata of an earlier one replay its plan.
    ``configs``: the launchers' current config choices (a plan made under others is stale)."""

    def wrap(launcher: Callable) -> Callable:
        plans: dict[tuple, object] = {}

        @functools.wraps(launcher)
        def call(*args, **kwargs):
            found = None if INTERPRET else _key(args, kwargs)
            if found is None or _recording() is not None:
                return launcher(*args, **kwargs)
            key, tensors = found
            plan = plans.get(key)
            if plan is _UNPLANNED:
                return launcher(*args, **kwargs)
            if plan is not None and plan.configs is configs():
                return _replay(plan, tensors)
            chosen = configs()  # the choices this call starts from
            _local.recording = recording = _Recording(tensors)
            try:
                result = launcher(*args, **kwargs)
            finally:
                _local.recording = None
            if len(plans) >= MAX_PLANS:
                plans.clear()
            made = recording.plan(result, chosen)
            plans[key] = _UNPLANNED if made is None else made
            return result

        call.plans = plans  # for tests
        return call

    return wrap


def _direct(compiled) -> tuple | None:
    """Triton's compiled launcher of ``compiled``, its fixed flags and the global scratch it
    takes per program (the forward's tensor descriptors, made on the device): the launcher
    object's ``__call__`` only adds the scratch allocations before it (a few us per launch),
    which a replay makes itself. Only for the Triton whose launcher signature this follows
    (3.6's ``CudaLauncher``) and kernels without profile scratch; None elsewhere."""
    run = compiled.run
    if not _DIRECT_LAUNCH or type(run).__name__ != "CudaLauncher" or run.profile_scratch_size:
        return None
    return (
        run.launch,
        run.launch_cooperative_grid,
        run.launch_pdl,
        run.global_scratch_size * run.num_ctas,
    )


def _scratch(size: int, alignment: int, stream) -> Tensor:
    """Triton's allocator for a kernel's global scratch: torch's caching allocator on the
    current device (a block of its is at least 512-byte aligned), whose stream order keeps
    the buffer until the kernel (launched on the current stream) has run."""
    return torch.empty(size, dtype=torch.uint8, device="cuda")


def _with_scratch(run: Callable, *args, **kwargs):
    """``run(*args, **kwargs)`` with :func:`_scratch` as Triton's allocator, in a copy of the
    context: the allocator a user set (triton.set_allocator, a context variable) stays."""

    def call():
        triton.set_allocator(_scratch)
        return run(*args, **kwargs)

    return contextvars.copy_context().run(call)


def _hook(hook):
    """A launch hook of Triton's, or None where it calls nothing. Triton 3.6's knobs hold an
    always-present ``HookChain`` (empty unless a profiler adds to it) where older ones held
    None; a plain function assigned to the knob is a hook too."""
    return None if hook is None or not getattr(hook, "calls", True) else hook


def _replay(plan: _Plan, inputs: list[Tensor]):
    device = inputs[0].device
    sources = list(inputs)
    for shape, dtype, zeroed in plan.allocations:
        make = torch.zeros if zeroed else allocate
        sources.append(make(shape, device=device, dtype=dtype))
    stream = torch._C._cuda_getCurrentRawStream(device.index)
    enter, exit_ = _hook(knobs.runtime.launch_enter_hook), _hook(knobs.runtime.launch_exit_hook)
    direct = enter is None and exit_ is None
    for step in plan.launches:
        values = step.values.copy()
        for i, src in step.slots:
            values[i] = sources[src]
        ck = step.compiled
        if direct and step.direct is not None:  # no hook: no launch metadata either
            launch, cooperative, pdl, per_program = step.direct
            gx, gy, gz = step.grid
            scratch = None
            if per_program:  # the launcher object would take it from Triton's allocator
                scratch = torch.empty(gx * gy * gz * per_program, dtype=torch.uint8, device=device)
            launch(gx, gy, gz, stream, ck.function, cooperative, pdl, scratch, None,
                   ck.packed_metadata, None, None, None, *values)  # fmt: skip
            continue
        meta = ck.launch_metadata(step.grid, stream, *values)
        _with_scratch(ck.run, *step.grid, stream, ck.function, ck.packed_metadata, meta, enter,
                      exit_, *values)  # fmt: skip
    results = tuple(None if r is None else sources[r] for r in plan.results)
    return results if len(results) > 1 else results[0]


def allocate(shape, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Every uninitialised buffer of the launchers and their replays (tests poison it)."""
    return torch.empty(shape, device=device, dtype=dtype)


def empty(shape, device: torch.device, dtype: torch.dtype) -> Tensor:
    """:func:`allocate`, recorded into the plan being made."""
    t = allocate(shape, device, dtype)
    if (recording := _recording()) is not None:
        recording.allocated(t, zeroed=False)
    return t


def zeros(shape, device: torch.device, dtype: torch.dtype) -> Tensor:
    """torch.zeros, recorded into the plan being made."""
    t = torch.zeros(shape, device=device, dtype=dtype)
    if (recording := _recording()) is not None:
        recording.allocated(t, zeroed=True)
    return t


def launch(kernel, grid: tuple[int, ...], **kwargs) -> None:
    """``kernel[grid](**kwargs)``, recorded into the plan being made."""
    if kwargs.get("WS"):  # compiled without Triton < 3.8's unused barriers (ws_barriers.py)
        with ws_barriers.compile_hook((kernel.fn.__name__,)):
            compiled = _with_scratch(kernel[grid], **kwargs)
    else:
        compiled = _with_scratch(kernel[grid], **kwargs)
    if (recording := _recording()) is not None:
        recording.launched(kernel, grid, kwargs, compiled)


def unplannable() -> None:
    """The launcher does tensor work a plan cannot replay on this path."""
    if (recording := _recording()) is not None:
        recording.ok = False


def _recording() -> _Recording | None:
    """The plan being made on this thread, if any."""
    return getattr(_local, "recording", None)
