"""Every error path: a clear exception naming the argument, raised before any launch."""

from __future__ import annotations

import pytest
import torch
from helpers import CUDA, DEVICE, needs_kernels, randn
from torch.autograd import forward_ad as fwAD

import flash_jvp
from flash_jvp import _ops, _utils


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Validation must reject before a kernel is launched."""

    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was launched for invalid input")

    monkeypatch.setattr(_ops, "attn_fwd", refuse)


def t(*shape, dtype=torch.float32, device=DEVICE):
    return randn(*shape, dtype=dtype, device=device)


def _nested():
    seqs = [t(2, n, 16).transpose(0, 1) for n in (3, 5)]  # (L, H, E) each
    nt = torch.nested.nested_tensor(seqs, layout=torch.jagged).transpose(1, 2)  # (B, H, j, E)
    return nt, nt, nt


BAD = [
    ("nested", _nested, {}, TypeError, r"does not take nested \(jagged\) tensors \(query\)"),
    ("not-a-tensor", lambda: ([[1.0]], t(1, 2, 8, 16), t(1, 2, 8, 16)), {}, TypeError,
     "Expected query to be a torch.Tensor"),
    ("2d", lambda: (t(8, 16), t(8, 16), t(8, 16)), {}, ValueError,
     r"at least 3 dimensions .*query of shape \(8, 16\)"),
    ("dtype-mismatch", lambda: (t(1, 2, 8, 16), t(1, 2, 8, 16, dtype=torch.float16),
                                t(1, 2, 8, 16)), {}, ValueError,
     "same dtype, but got query.dtype: torch.float32, key.dtype: torch.float16"),
    ("batch-mismatch", lambda: (t(2, 2, 8, 16), t(1, 2, 8, 16), t(1, 2, 8, 16)), {},
     ValueError, r"same batch dimensions .*query \(2, 2, 8, 16\)"),
    ("ndim-mismatch", lambda: (t(1, 2, 8, 16), t(2, 8, 16), t(2, 8, 16)), {}, ValueError,
     "same batch dimensions"),
    ("kv-length-mismatch", lambda: (t(1, 2, 8, 16), t(1, 2, 8, 16), t(1, 2, 9, 16)), {},
     ValueError, r"key and value to have the same number of heads and length"),
    ("head-dim-mismatch", lambda: (t(1, 2, 8, 16), t(1, 2, 8, 32), t(1, 2, 8, 16)), {},
     ValueError, "same head_dim"),
    ("heads-without-gqa", lambda: (t(1, 4, 8, 16), t(1, 2, 8, 16), t(1, 2, 8, 16)), {},
     ValueError, "query has 4, key/value 2.*enable_gqa=True"),
    ("heads-not-multiple", lambda: (t(1, 3, 8, 16), t(1, 2, 8, 16), t(1, 2, 8, 16)),
     {"enable_gqa": True}, ValueError, r"query heads \(3\) must be a multiple"),
    ("empty-key", lambda: (t(1, 2, 8, 16), t(1, 2, 0, 16), t(1, 2, 0, 16)), {}, ValueError,
     "key to have length >= 1"),
    ("integer-dtype", lambda: tuple(torch.ones(1, 2, 8, 16, dtype=torch.int32, device=DEVICE)
                                    for _ in range(3)), {}, TypeError, "floating-point query"),
    ("head-dim-too-big", lambda: (t(1, 2, 8, 300), t(1, 2, 8, 300), t(1, 2, 8, 300)), {},
     NotImplementedError, "head_dim 300 is not supported; supported head dims are 1 to 256"),
    ("value-head-dim-too-big", lambda: (t(1, 2, 8, 16), t(1, 2, 8, 16), t(1, 2, 8, 512)), {},
     NotImplementedError, "value head_dim 512"),
    ("dropout", lambda: (t(1, 2, 8, 16), t(1, 2, 8, 16), t(1, 2, 8, 16)), {"dropout_p": 0.1},
     NotImplementedError, "dropout_p=0.1 is not supported"),
    ("dropout-range", lambda: (t(1, 2, 8, 16), t(1, 2, 8, 16), t(1, 2, 8, 16)),
     {"dropout_p": 1.5}, ValueError, r"dropout_p in \[0, 1\]"),
    ("is-causal-type", lambda: (t(1, 2, 8, 16), t(1, 2, 8, 16), t(1, 2, 8, 16)),
     {"is_causal": "yes"}, TypeError, "is_causal to be a bool"),
    ("scale-type", lambda: (t(1, 2, 8, 16), t(1, 2, 8, 16), t(1, 2, 8, 16)), {"scale": "0.1"},
     TypeError, "scale to be None or a real number"),
]  # fmt: skip


KERNEL_ONLY = {"head-dim-too-big", "value-head-dim-too-big"}  # the fallback has no such limit


@pytest.mark.parametrize("name,make,kwargs,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_clear_error(name, make, kwargs, exc, match):
    if name in KERNEL_ONLY and not _utils.uses_kernels(torch.device(DEVICE)):
        pytest.skip("a limit of the Triton kernels; the CPU fallback has none")
    q, k, v = make()
    with pytest.raises(exc, match=match):
        flash_jvp.attention(q, k, v, **kwargs)
    assert flash_jvp.supports(q, k, v, **kwargs), "supports() must report the same problem"


def test_supports_is_empty_for_good_input():
    q = t(1, 2, 8, 16)
    assert flash_jvp.supports(q, q, q, is_causal=True) == []


@pytest.mark.skipif(CUDA, reason="the interpreter's dtype limits are a CPU-tier matter")
def test_bfloat16_under_interpreter_is_refused():
    if not _utils.INTERPRET:
        pytest.skip("only the interpreter refuses bf16; the fallback runs it")
    q = t(1, 2, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="not supported by Triton's CPU interpreter"):
        flash_jvp.attention(q, q, q)


@pytest.mark.gpu
def test_float64_on_cuda_is_refused():
    q = t(1, 2, 8, 16, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="torch.float64 .* supported dtypes are"):
        flash_jvp.attention(q, q, q)


@pytest.mark.gpu
def test_device_mismatch():
    q = t(1, 2, 8, 16)
    with pytest.raises(ValueError, match="same device"):
        flash_jvp.attention(q, q.cpu(), q)


MORE_BAD = [
    ("scale-inf", {"scale": float("inf")}, ValueError, "finite scale within float32 range"),
    ("scale-huge", {"scale": 1e300}, ValueError, "finite scale within float32 range"),
    ("scale-huge-int", {"scale": 10**400}, ValueError, "finite scale within float32 range"),
    ("enable-gqa-type", {"enable_gqa": "no"}, TypeError, "enable_gqa to be a bool"),
]


@pytest.mark.parametrize(
    "kwargs,exc,match", [b[1:] for b in MORE_BAD], ids=[b[0] for b in MORE_BAD]
)
def test_bad_arguments(kwargs, exc, match):
    q = t(1, 2, 8, 16)
    with pytest.raises(exc, match=match):
        flash_jvp.attention(q, q, q, **kwargs)


def test_zero_head_dim():
    q = t(1, 2, 8, 0)
    with pytest.raises(ValueError, match="head_dim >= 1"):
        flash_jvp.attention(q, q, t(1, 2, 8, 16))


@pytest.mark.parametrize("arg", ["query", "value", "attn_mask"])
def test_tangent_dtype_must_match_its_primal(path, arg):
    """torch's make_dual pairs any floating dtypes; both paths name the argument (the
    fallback used to raise torch's 'expected scalar type', naming none)."""
    args = {"query": t(1, 2, 8, 16), "key": t(1, 2, 8, 16), "value": t(1, 2, 8, 16),
            "attn_mask": t(1, 1, 8, 8)}  # fmt: skip
    tangent = args[arg].double()  # the inputs are float32
    match = f"tangent of {arg} to have its dtype {args[arg].dtype}"
    with pytest.raises(ValueError, match=match):
        torch.func.jvp(lambda x: flash_jvp.attention(**{**args, arg: x}), (args[arg],), (tangent,))
    with fwAD.dual_level(), pytest.raises(ValueError, match=match):
        flash_jvp.attention(**{**args, arg: fwAD.make_dual(args[arg], tangent)})


def test_varlen_tangent_dtype_must_match_its_primal(path):
    q = t(12, 2, 16)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=q.device)
    with pytest.raises(ValueError, match=f"tangent of k to have its dtype {q.dtype}"):
        torch.func.jvp(
            lambda k: flash_jvp.varlen_attention(q, k, q, cu, cu, 7, 7), (q,), (q.double(),)
        )


@needs_kernels
def test_batch_times_heads_beyond_the_grid_is_refused_and_listed():
    """CUDA's grid limit on batch * heads: supports() names it, the call raises it."""
    q = t(1, 1, 4, 8).expand(65536, 1, 4, 8)
    reasons = flash_jvp.supports(q, q, q)
    assert any("batch * heads = 65536" in r for r in reasons), reasons
    with pytest.raises(NotImplementedError, match="batch \\* heads = 65536"):
        flash_jvp.attention(q, q, q)


@needs_kernels
@pytest.mark.parametrize("layout", ["square", "strided"])
def test_mask_spanning_2_31_elements_is_listed_and_refused(layout):
    """An attn_mask whose entries for one (batch, head) span >= 2**31 elements: supports()
    lists it (it returned [] while the call refused) and the refusal names the user's mask,
    not the kernels' 4-D view. The masks are never written, so their memory is not touched."""
    if layout == "square":  # the fresh-user trial's case: a 46341 x 46341 boolean mask
        q = t(1, 1, 46341, 8)
        mask = torch.empty(46341, 46341, dtype=torch.bool, device=DEVICE)
    else:  # two rows 2**31 elements apart
        q = t(1, 1, 2, 8)
        storage = torch.empty(2**31 + 2, dtype=torch.bool, device=DEVICE)
        mask = storage.as_strided((2, 2), (2**31, 1))
    found = flash_jvp.supports(q, q, q, attn_mask=mask)
    assert any("spanning" in m for m in found), found
    with pytest.raises(NotImplementedError, match=r"attn_mask of shape \((46341, 46341|2, 2)\)"):
        flash_jvp.attention(q, q, q, attn_mask=mask)


@pytest.mark.skipif(CUDA, reason="the message for a torch without CUDA")
def test_check_on_cuda_without_cuda_exits_cleanly(capsys):
    """`python -m flash_jvp check --device cuda` on a CPU-only torch: a message and exit code
    2, as `bench` gives (was: torch's AssertionError 'Torch not compiled with CUDA')."""
    from flash_jvp import cli

    assert cli.main(["check", "--device", "cuda"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
