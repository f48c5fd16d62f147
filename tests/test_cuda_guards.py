"""What the CUDA paths assume, checked on the CPU: MoE's grouped-GEMM guard against torch._grouped_mm's
own checks (its meta function, which torch.compile runs); DSA's CSR selections (what cuSPARSE gets)
sorted and duplicate-free, on the selections a model builds with documents; a failed fla import said
once, with its error, when a tensor on a kernel device would have used it."""
import sys
import warnings

import pytest
import torch

import model.mixers.dsa as dsa_mixer
import model.ops.sparse_attention.selection as selection
from model import DecoderLM, LMConfig
from model.ffn.experts import experts_grouped_mm, grouped_mm_takes
from model.ops import kernels
from model.ops.gated_delta import chunk_gated_delta_rule
from model.ops.linear_attention import chunk_linear_attn
from model.ops.sparse_attention.attention import SPARSE_KEY_COST
from model.ops.ssd import mamba_chunk_scan

pytestmark = pytest.mark.usefixtures("one_thread")


def grouped_mm_runs(dtype: torch.dtype, d: int, f: int) -> str | None:
    """None if experts_grouped_mm runs forward and backward on meta tensors of this dtype and widths,
    else torch's error."""
    xs = torch.empty(10, d, dtype=dtype, device="meta", requires_grad=True)
    w_gu = torch.empty(3, d, 2 * f, dtype=dtype, device="meta", requires_grad=True)
    w_d = torch.empty(3, f, d, dtype=dtype, device="meta", requires_grad=True)
    try:
        ys = experts_grouped_mm(xs, w_gu, w_d, torch.tensor([3, 0, 7], device="meta"))
        torch.autograd.grad(ys, (xs, w_gu, w_d), torch.empty_like(ys))
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("d, f", [(64, 64), (64, 40), (56, 24), (64, 100), (100, 64), (64, 36), (36, 64)])
def test_grouped_mm_guard_is_the_ops_own_check(dtype, d, f):
    """The guard says yes exactly when torch's checks pass: bf16 only (fp32 fails when compiled) and
    16-byte rows for d and for the expert width f (f = 100 with d = 64 fails in the second GEMM)."""
    error = grouped_mm_runs(dtype, d, f)
    assert grouped_mm_takes(dtype, d, f) == (error is None), error


@pytest.fixture
def fla_broken(monkeypatch):
    """`import fla` fails (as with a broken install) and nothing was reported or cached yet; afterwards
    the import is tried afresh."""
    for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fla", None)  # import fla -> ModuleNotFoundError
    monkeypatch.setattr(kernels, "_unavailable", set())
    kernels._imported.cache_clear()
    yield
    kernels._imported.cache_clear()


def run_the_three_fla_ops():
    """GDN, linear attention and the SSD, each of which would call an fla kernel on a kernel device."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, 4, generator=g) for _ in range(3))
    gate, beta = -torch.rand(1, 5, 2, generator=g), torch.rand(1, 5, 2, generator=g)
    chunk_gated_delta_rule(q, k, v, gate, beta)
    chunk_linear_attn(q, k, v)
    mamba_chunk_scan(v, gate, -torch.ones(2), q, k, chunk_size=4)


def test_failed_fla_import_is_said_once_with_its_error(fla_broken, monkeypatch):
    monkeypatch.setattr(kernels, "KERNEL_DEVICES", ("cpu",))  # CPU tensors stand for CUDA ones
    with pytest.warns(RuntimeWarning) as said:
        run_the_three_fla_ops()
        run_the_three_fla_ops()
    assert len(said) == 1, [str(w.message) for w in said]
    message = str(said[0].message)
    assert message.startswith("fla does not import (ModuleNotFoundError: ") and \
        "PyTorch path" in message and "requirements-gpu.txt" in message


def test_no_word_where_no_kernel_would_run(fla_broken):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails
        run_the_three_fla_ops()  # CPU tensors: the kernels are not looked up
    assert kernels._imported.cache_info().currsize == 0


def dsa_step(ids, positions, train: bool):
    """Loss and gradients of a 1-layer DSA model (sparse stage, top-k 8) on a packed batch with documents."""
    torch.manual_seed(0)
    config = LMConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, mixer="dsa", mixer_options={"dsa": {"topk": 8, "index_head_dim": 16,
                                                                                  "index_rope_dim": 8}})
    model = DecoderLM(config).train(train)
    out = model(ids, labels=ids, position_ids=positions, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_dsa_csr_selections_are_sorted_and_duplicate_free(monkeypatch):
    """The csr backend (what CUDA runs, with the CUDA top-k path) on the selections a model builds from a
    batch of documents (short ones leave empty slots): every CSR handed to torch.sparse passes torch's
    invariant check (each row's columns sorted and distinct), each row holds exactly its query's selected
    keys, and loss and gradients equal the numba backend's."""
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    positions = torch.stack([torch.cat([torch.arange(3), torch.arange(12), torch.arange(25)]),
                             torch.cat([torch.arange(5, 15), torch.arange(30)])])
    monkeypatch.setitem(SPARSE_KEY_COST, "cpu", 0.0)  # the sparse path (SDDMM / SpMM) at any length
    want = {train: dsa_step(ids, positions, train) for train in (True, False)}

    monkeypatch.setattr(selection, "_numba_runs", lambda device: False)  # the csr backend and the torch top-k
    checked, selections = [], []

    def checked_csr(crow, col, values, size):
        checked.append(size)
        with warnings.catch_warnings():  # torch warns that CSR support is in beta
            warnings.simplefilter("ignore", UserWarning)
            return torch.sparse_csr_tensor(crow, col, values, size, check_invariants=True)

    def kept_selection(*args, **kwargs):
        selections.append(selection.Selection(*args, **kwargs))
        return selections[-1]

    monkeypatch.setattr(selection, "_csr", checked_csr)
    monkeypatch.setattr(dsa_mixer, "Selection", kept_selection)
    for train in (True, False):  # training (indexer loss) and eval (recall) forwards
        loss, grads = dsa_step(ids, positions, train)
        torch.testing.assert_close(loss, want[train][0])
        for name, grad in want[train][1].items():
            torch.testing.assert_close(grads[name], grad, msg=name)
    assert len(selections) == 2 and checked  # a selection per forward; the CSRs it built were checked
    for sel in selections:
        assert sel.backend == "csr" and (~sel.valid).any()  # empty slots: short documents
        rows = torch.tensor_split(sel.col.long(), sel.crow[1:-1].long())
        B, T, _ = sel.indices.shape
        for r, cols in enumerate(rows):
            b, t = divmod(r, T)
            selected = sel.indices[b, t][sel.valid[b, t]] + b * sel.num_keys
            assert cols.tolist() == sorted(set(selected.tolist())) == sorted(selected.tolist()), (b, t)
        crow_t, col_t, _ = sel._transposed
        checked_csr(crow_t, col_t, torch.ones(col_t.numel()), (sel.col_count, sel.rows))
