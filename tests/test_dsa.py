"""DeepSeek Sparse Attention: the ops against per-token loops written from the formulas (float64), and
the mixer against softmax attention, its stages, checkpoint loading, warm-up and decoding."""
import pytest
import torch

import model.ops.sparse_attention.attention as sa
import model.ops.sparse_attention.lightning_indexer as li
import model.ops.sparse_attention.selection as selection
from conftest import assert_bf16_rounding_of
from model import DecodeCache, DecoderLM, LMConfig
from model.layers import AuxCollector
from model.mixers.dsa import DSAttention
from model.mixers.softmax import SoftmaxAttention, attend
from model.ops.sparse_attention.naive import naive_index_scores, naive_masked_attention, naive_sparse_attention

F64 = torch.float64


def rand(*shape, g, dtype=F64, requires_grad=True):
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(requires_grad)


def grads(out, inputs, g):
    return torch.autograd.grad((out * g).sum(), inputs)


@pytest.fixture(params=["small_blocks", "one_block"])
def blocks(request, monkeypatch):
    """Run each op test with blocks of a few queries (uneven last block) and with one block, for the
    dense ops' query blocks and index_topk's alike; afterwards, that every query loop of the test ran
    in the blocks it names."""
    if request.param == "small_blocks":
        monkeypatch.setattr(sa, "_BLOCK_ELEMS", 700)
        monkeypatch.setattr(li, "_INDEX_BLOCK_ELEMS", 100)  # 2 queries per block at T = S = 13, H_I = 3
    counts, split = [], sa._blocks

    def counted(*args):
        out = list(split(*args))
        counts.append(len(out))
        return out

    monkeypatch.setattr(sa, "_blocks", counted)
    yield
    assert counts and all(n > 1 if request.param == "small_blocks" else n == 1 for n in counts), counts


def indexer_inputs(B=2, T=13, H_I=3, d_I=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return rand(B, T, H_I, d_I, g=g), rand(B, T, d_I, g=g), rand(B, T, H_I, g=g)


def attention_inputs(B=2, T=13, H=4, Hkv=2, D=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return rand(B, T, H, D, g=g), rand(B, T, Hkv, D, g=g), rand(B, T, Hkv, D, g=g)


# ---- ops ------------------------------------------------------------------------------------------

def test_index_scores_match_formula():
    q_i, k_i, w = indexer_inputs()
    torch.testing.assert_close(li.index_scores(q_i, k_i, w), naive_index_scores(q_i, k_i, w))


@pytest.fixture(params=["numba", "torch"])
def topk_kernel(request, monkeypatch):
    """Run an index_topk test with the CPU kernel and with the torch ops that other devices run."""
    if request.param == "torch":
        monkeypatch.setattr(selection, "_numba_runs", lambda device: False)


def assert_top_visible(idx, ref, first_visible, topk):
    """Each query's selected keys are distinct, visible (first_visible[b, t] <= s <= t) and hold its
    largest reference scores (compared as values: robust to ties)."""
    B, T = ref.shape[:2]
    for b in range(B):
        for t in range(T):
            lo = int(first_visible[b, t])
            sel = idx[b, t][idx[b, t] >= 0]
            assert len(sel) == min(topk, t + 1 - lo) and len(set(sel.tolist())) == len(sel)
            assert lo <= int(sel.min()) and int(sel.max()) <= t
            torch.testing.assert_close(ref[b, t, sel].sort().values, ref[b, t, lo: t + 1].sort().values[-len(sel):])


@pytest.mark.parametrize("topk", [1, 5, 13, 20])
def test_index_topk_selects_the_top_visible_keys(blocks, topk_kernel, topk):
    q_i, k_i, w = indexer_inputs()
    ref = naive_index_scores(q_i, k_i, w).detach()
    idx = li.index_topk(q_i, k_i, w, topk)
    T = ref.shape[1]
    assert idx.shape == (2, T, min(topk, T))
    assert_top_visible(idx, ref, torch.zeros(2, T), topk)
    # queries at an offset (a prefill continuing a cache) select the same keys
    late = li.index_topk(q_i[:, 6:], k_i, w[:, 6:], topk, offset=6)
    assert torch.equal(late.sort(-1).values, idx[:, 6:].sort(-1).values)


@pytest.mark.parametrize("topk", [2, 40])  # 40 > T: every query selects its whole document
def test_index_topk_within_documents(topk_kernel, topk):
    q_i, k_i, w = indexer_inputs(T=50)
    starts = torch.zeros(2, 50, dtype=torch.bool)
    starts[0, [0, 9, 10, 31]] = starts[1, [0, 44]] = True
    segment_ids = starts.cumsum(1)
    ref = naive_index_scores(q_i, k_i, w).detach()
    idx = li.index_topk(q_i, k_i, w, topk, segment_ids=segment_ids)
    first = torch.stack([torch.searchsorted(row, row) for row in segment_ids])  # each document's start
    assert_top_visible(idx, ref, first, topk)


@pytest.mark.parametrize("backend", selection.Selection.BACKENDS)
def test_index_scores_at_match_dense_scores_values_and_grads(backend):
    q_i, k_i, w = indexer_inputs()
    idx = li.index_topk(q_i, k_i, w, 4)
    out = li.index_scores_at(q_i, k_i, w, selection.Selection(idx, k_i.shape[1], backend))
    ref = naive_index_scores(q_i, k_i, w).gather(-1, idx.clamp(min=0)).masked_fill(idx < 0, float("-inf"))
    torch.testing.assert_close(out, ref)
    g = torch.randn(out.shape, dtype=F64).masked_fill(idx < 0, 0)
    finite = lambda x: x.masked_fill(idx < 0, 0)  # noqa: E731
    for a, r in zip(grads(finite(out), (q_i, k_i, w), g), grads(finite(ref), (q_i, k_i, w), g)):
        torch.testing.assert_close(a, r)


def sparse_on(backend):
    return lambda q, k, v, idx: sa.sparse_attention(q, k, v, selection.Selection(idx, k.shape[1], backend))


# the sparse path on each Selection backend (numba: CPU's default; csr: what CUDA runs, also on CPU)
PATHS = {"sparse": sa.sparse_attention, "sparse_csr": sparse_on("csr"), "masked": sa.masked_attention}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("Hkv,topk", [(1, 4), (2, 1), (2, 9), (4, 4)])
def test_both_paths_match_dense_masked_reference_and_formula(blocks, path, Hkv, topk):
    q, k, v = attention_inputs(Hkv=Hkv)  # T = 13: no block or tile size divides it
    idx = li.index_topk(*indexer_inputs(), topk)
    out, ref = PATHS[path](q, k, v, idx), naive_masked_attention(q, k, v, idx)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out, naive_sparse_attention(q, k, v, idx))
    g = torch.randn(out.shape, dtype=F64)
    for a, r in zip(grads(out, (q, k, v), g), grads(ref, (q, k, v), g)):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("path", PATHS)
def test_both_paths_for_queries_after_a_prefix(blocks, path):
    """The T queries are the last T of the S keys (a prefill continuing a cache)."""
    q, k, v = attention_inputs(Hkv=1)
    q_i, k_i, w = indexer_inputs()
    idx = li.index_topk(q_i[:, 6:], k_i, w[:, 6:], 4, offset=6)
    q = q[:, 6:].detach().requires_grad_()
    out, ref = PATHS[path](q, k, v, idx), naive_masked_attention(q, k, v, idx)
    torch.testing.assert_close(out, ref)
    g = torch.randn(out.shape, dtype=F64)
    for a, r in zip(grads(out, (q, k, v), g), grads(ref, (q, k, v), g)):
        torch.testing.assert_close(a, r)


def test_sparse_path_returns_the_selected_attention_probs():
    q, k, v = attention_inputs()
    sel = selection.Selection(li.index_topk(*indexer_inputs(), 4), k.shape[1])
    _, p = sa.sparse_attention_with_probs(q, k, v, sel)
    assert not p.requires_grad
    torch.testing.assert_close(p, sa.selected_attention_probs(q, k, sel))


def test_selection_hands_the_sparse_kernels_32_bit_indices():
    """MKL / cuSPARSE take 32-bit indices; int64 ones are converted on every SDDMM / SpMM call."""
    q, k, v = attention_inputs()
    idx = li.index_topk(*indexer_inputs(), 4)
    assert selection.Selection(idx, k.shape[1]).key_rows.dtype == torch.int32
    sel = selection.Selection(idx, k.shape[1], "csr")
    for m in (sel.matrix(torch.ones(sel.rows, 4, dtype=F64)), sel.matrix_t(torch.ones(sel.rows, 4, dtype=F64))):
        assert m.crow_indices().dtype == m.col_indices().dtype == torch.int32


@pytest.mark.parametrize("K", [4, 7])  # 7: the kernels' 4-key blocks leave a remainder
def test_cpu_logits_match_einsum(K):
    """cpu_kernels.logits against a dense gather (float64), with empty slots and 2 KV heads of 3 query
    heads each (the other kernels are checked through the ops, against the naive references)."""
    from model.ops.sparse_attention import cpu_kernels
    g = torch.Generator().manual_seed(K)
    R, N, H, Hkv, D = 11, 9, 6, 2, 5
    a, b = torch.randn(R, H, D, generator=g, dtype=F64), torch.randn(N, Hkv, D, generator=g, dtype=F64)
    idx = torch.randint(0, N, (R, K), generator=g, dtype=torch.int32)
    idx[::3, 1] = -1
    gathered = b.repeat_interleave(H // Hkv, 1)[idx.clamp(min=0).long()]  # [R, K, H, D]
    ref = 0.3 * torch.einsum("rhd,rkhd->rhk", a, gathered).masked_fill(idx[:, None] < 0, float("-inf"))
    torch.testing.assert_close(cpu_kernels.logits(a, b, idx, 0.3), ref)


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_sparse_path_runs_the_numba_kernels(monkeypatch, threads):
    """On CPU tensors the sparse path and the indexer scores go through cpu_kernels, fwd and bwd, and
    with 2 threads the kernels that scatter into key rows sum one partial output per block of rows."""
    from model.ops.sparse_attention import cpu_kernels
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    calls = []
    for name in ("logits", "gathered_sum", "softmax_grads", "scattered_sum", "index_scores", "index_grads"):
        fn = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda *a, fn=fn, name=name: calls.append(name) or fn(*a))
    q, k, v = attention_inputs()
    q_i, k_i, w = indexer_inputs()
    sel = selection.Selection(li.index_topk(q_i, k_i, w, 4), k.shape[1])
    assert sel.backend == "numba"
    ref = selection.Selection(sel.indices, k.shape[1], "csr")
    g = torch.randn(2, 13, 4, dtype=F64)
    out = [sa.sparse_attention(q, k, v, s).sum() + (li.index_scores_at(q_i, k_i, w, s).clamp(min=-1) * g).sum()
           for s in (sel, ref)]
    assert sorted(calls) == ["gathered_sum", "index_scores", "logits"]  # fwd: attention, indexer
    got, want = (torch.autograd.grad(o, (q, k, v, q_i, k_i, w)) for o in out)
    assert sorted(calls) == ["gathered_sum"] * 2 + ["index_grads", "index_scores", "logits"] + ["scattered_sum"] * 2 \
        + ["softmax_grads"]
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r)


def test_selection_rejects_a_bad_backend():
    with pytest.raises(ValueError, match="'dense'.*numba.*csr"):
        selection.Selection(torch.zeros(1, 2, 1, dtype=torch.long), 2, "dense")


def test_attention_path_cost_model_logs_each_choice_once(caplog, monkeypatch):
    monkeypatch.setattr(sa, "_logged_choices", set())
    K, cost = 256, sa.SPARSE_KEY_COST["cpu"]
    short, long = int(K * cost), int(4 * K * cost)  # mean keys a query block reads: S - T / 2 = T / 2
    with caplog.at_level("INFO", logger=sa.__name__):
        assert sa.attention_path(short, short, K, 4, 1, "cpu") == "masked"
        assert sa.attention_path(long, long, K, 4, 1, "cpu") == "sparse"
        assert sa.attention_path(long, long, K, 4, 1, "cpu") == "sparse"
        assert sa.attention_path(1, long, K, 4, 1, "cpu") == "sparse"  # decoding one token
    assert [r.getMessage().split(" path")[0] for r in caplog.records] == \
        ["dsa attention: masked", "dsa attention: sparse"]  # each path logged once


@pytest.mark.parametrize("path", ["sparse", "masked"])
def test_selected_attention_runs_the_chosen_path(monkeypatch, path):
    q, k, v = attention_inputs()
    sel = selection.Selection(li.index_topk(*indexer_inputs(), 4), k.shape[1])
    monkeypatch.setattr(sa, "attention_path", lambda *args: path)
    ran = []
    for name in ("sparse_attention_with_probs", "masked_attention"):
        fn = getattr(sa, name)
        monkeypatch.setattr(sa, name, lambda *a, fn=fn, name=name: ran.append(name) or fn(*a))
    o, p = sa.selected_attention(q, k, v, sel, with_probs=True)
    assert ran == ["sparse_attention_with_probs" if path == "sparse" else "masked_attention"]
    torch.testing.assert_close(o, naive_masked_attention(q, k, v, sel.indices))
    torch.testing.assert_close(p, sa.selected_attention_probs(q, k, sel))


@pytest.mark.parametrize("S,k", [(64, 4), (1001, 7), (300, 30)])
def test_two_stage_topk_is_exact(S, k):
    assert li._topk_chunks(S, k) >= 2  # the two-stage path runs
    g = torch.Generator().manual_seed(S)
    x = torch.randn(5, S, generator=g).relu()  # many tied zeros
    x[0, S // 2:] = float("-inf")
    idx = li.topk_indices(x, k)
    assert all(len(set(row.tolist())) == k for row in idx)
    torch.testing.assert_close(x.gather(-1, idx).sort(-1).values, x.topk(k, -1).values.sort(-1).values)


@pytest.mark.parametrize("path", PATHS)
def test_both_paths_with_all_keys_are_causal_softmax_attention(path):
    q, k, v = attention_inputs()
    idx = li.index_topk(*indexer_inputs(), 13)
    out = PATHS[path](q, k, v, idx)
    ref = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(out, ref)
    g = torch.randn(out.shape, dtype=F64)
    for a, r in zip(grads(out, (q, k, v), g), grads(ref, (q, k, v), g)):
        torch.testing.assert_close(a, r)


def test_sparse_attention_fp32_accumulation_for_bf16_inputs():
    """bf16 q, k, v with logits up to ~10 over 32 selected keys: the output is the float64 attention of
    the same bf16 values rounded once to bf16, which the same attention computed in bf16 (rounded
    logits and probabilities) is not."""
    g = torch.Generator().manual_seed(0)
    q = (3 * torch.randn(1, 64, 4, 32, generator=g)).bfloat16()
    k, v = (torch.randn(1, 64, 1, 32, generator=g).bfloat16() for _ in range(2))
    idx = li.index_topk(*(x.detach().float() for x in indexer_inputs(B=1, T=64, seed=2)), 32)
    ref = naive_masked_attention(q.double(), k.double(), v.double(), idx)
    out = sa.sparse_attention(q, k, v, idx)
    assert out.dtype == torch.bfloat16
    assert_bf16_rounding_of(out, ref)
    with pytest.raises(AssertionError):  # accumulating in bf16 fails at this size
        assert_bf16_rounding_of(naive_masked_attention(q, k, v, idx), ref)


def test_ops_keep_fp32_under_autocast():
    q, k, v = (x.detach().float() for x in attention_inputs())
    q_i, k_i, w = (x.detach().float() for x in indexer_inputs())
    idx = li.index_topk(q_i, k_i, w, 4)
    ref = (sa.sparse_attention(q, k, v, idx), li.index_scores_at(q_i, k_i, w, idx), li.index_scores(q_i, k_i, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = (sa.sparse_attention(q, k, v, idx), li.index_scores_at(q_i, k_i, w, idx), li.index_scores(q_i, k_i, w))
    for a, r in zip(out, ref):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, r)


def test_attention_probs_match_formula(blocks):
    q, k, _ = attention_inputs()
    idx = li.index_topk(*indexer_inputs(), 4)
    B, T, H, D = q.shape
    s = torch.einsum("bthd,bshd->bhts", q, k.repeat_interleave(2, dim=2)) * D**-0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    dense = s.masked_fill(~causal, float("-inf")).softmax(-1).mean(1)  # head-averaged causal softmax
    torch.testing.assert_close(sa.dense_attention_probs(q, k), dense.detach())
    # restricted to the selected keys: renormalised per head, then head-averaged
    sel = s.gather(-1, idx.clamp(min=0)[:, None].expand(-1, H, -1, -1)).masked_fill(idx[:, None] < 0, float("-inf"))
    torch.testing.assert_close(sa.selected_attention_probs(q, k, idx), sel.softmax(-1).mean(1).detach())
    # a query's later positions start at `offset`
    torch.testing.assert_close(sa.dense_attention_probs(q[:, 5:], k, offset=5), dense[:, 5:].detach())


# ---- mixer ----------------------------------------------------------------------------------------

def tiny_config(**dsa_options):
    return LMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, mixer="dsa", mixer_options={"dsa": dsa_options},
                    max_position_embeddings=64)


def mixer_pair(**dsa_options):
    torch.manual_seed(0)
    cfg = tiny_config(index_heads=3, index_head_dim=8, index_rope_dim=4, **dsa_options)
    dsa = DSAttention(cfg).double()
    soft = SoftmaxAttention(cfg).double()
    for p in dsa.parameters():
        torch.nn.init.normal_(p, std=0.3)
    result = soft.load_state_dict(dsa.state_dict(), strict=False)
    assert not result.missing_keys and all(k.startswith("indexer.") for k in result.unexpected_keys)
    return dsa, soft


@pytest.mark.parametrize("stage", ["sparse", "warmup"])
def test_topk_at_least_T_equals_softmax_attention(stage):
    dsa, soft = mixer_pair(topk=16, stage=stage)
    x = torch.randn(2, 16, 32, dtype=F64, requires_grad=True)
    y, ref = dsa(x, None, AuxCollector()), soft(x)
    torch.testing.assert_close(y, ref)
    g = torch.randn(y.shape, dtype=F64)
    params = [dsa.q_proj.weight, dsa.k_proj.weight, dsa.v_proj.weight, dsa.o_proj.weight]
    ref_params = [soft.q_proj.weight, soft.k_proj.weight, soft.v_proj.weight, soft.o_proj.weight]
    for a, r in zip(grads(y, [x] + params, g), grads(ref, [x] + ref_params, g)):
        torch.testing.assert_close(a, r)


@pytest.fixture(params=["sparse", "masked"])
def forced_path(request, monkeypatch):
    """Run a mixer test with each attention path (the cost model would pick masked at these lengths)."""
    monkeypatch.setattr(sa, "attention_path", lambda *args: request.param)


@pytest.mark.parametrize("stage", ["sparse", "warmup"])
def test_gradient_isolation(stage, forced_path):
    dsa, _ = mixer_pair(topk=4, stage=stage)
    x = torch.randn(2, 12, 32, dtype=F64, requires_grad=True)
    aux = AuxCollector()
    y = dsa(x, None, aux)
    (kl, coef), = aux.losses["dsa/indexer_kl"]
    assert coef == 1.0 and kl > 0
    indexer = [p for n, p in dsa.named_parameters() if n.startswith("indexer.")]
    main = [p for n, p in dsa.named_parameters() if not n.startswith("indexer.")]
    lm_grads = torch.autograd.grad((y * torch.randn_like(y)).sum(), indexer + main + [x], allow_unused=True,
                                   retain_graph=True)
    assert all(g is None for g in lm_grads[: len(indexer)])  # LM loss: nothing reaches the indexer
    assert all(g is not None and g.abs().sum() > 0 for g in lm_grads[len(indexer):])
    kl_grads = torch.autograd.grad(kl, indexer + main + [x], allow_unused=True)
    assert all(g is not None and g.abs().sum() > 0 for g in kl_grads[: len(indexer)])
    assert all(g is None for g in kl_grads[len(indexer):])  # KL: nothing reaches the model or its input


def test_warmup_step_changes_only_indexer_parameters():
    torch.manual_seed(0)
    model = DecoderLM(tiny_config(topk=4, stage="warmup"))
    for n, p in model.named_parameters():
        p.requires_grad_("indexer" in n)  # what train.trainable=[indexer] does
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ids = torch.randint(0, 64, (2, 16))
    model(ids, labels=ids).loss.backward()
    opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != ("indexer" in n), n


def test_softmax_checkpoint_loads_into_dsa(tmp_path):
    torch.manual_seed(0)
    soft = DecoderLM(LMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2))
    soft.save_pretrained(tmp_path)
    dsa, info = DecoderLM.from_pretrained(tmp_path, mixer="dsa", mixer_options={"dsa": {"topk": 16}},
                                          output_loading_info=True)
    assert info["missing_keys"] and all(".mixer.indexer." in k for k in info["missing_keys"])
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert all(torch.isfinite(p).all() for p in dsa.parameters())
    torch.testing.assert_close(dsa.layers[0].mixer.indexer.k_norm.weight, torch.ones(32))
    ids = torch.randint(0, 64, (2, 16))
    assert torch.equal(dsa(ids, labels=ids).lm_loss, soft(ids, labels=ids).lm_loss)


def recall(model, ids):
    model.eval()
    with torch.no_grad():
        r = model(ids).aux_metrics["dsa/topk_attention_recall"].item()
    model.train()
    return r


def test_warmup_raises_topk_attention_recall():
    torch.manual_seed(0)
    model = DecoderLM(tiny_config(topk=4, stage="warmup", index_heads=4, index_head_dim=16, index_rope_dim=8))
    with torch.no_grad():  # peaked attention, as in a trained model (at init it is near uniform)
        for block in model.layers:
            block.mixer.q_proj.weight.mul_(30)
            block.mixer.k_proj.weight.mul_(30)
    for n, p in model.named_parameters():
        p.requires_grad_("indexer" in n)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    held_out = torch.randint(0, 64, (4, 32))
    start = recall(model, held_out)
    for _ in range(24):
        ids = torch.randint(0, 64, (4, 32))
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    end = recall(model, held_out)
    assert end > start + 0.1, (start, end)


def test_decoding_matches_full_forward(forced_path):
    torch.manual_seed(0)
    model = DecoderLM(tiny_config(topk=5, index_heads=8, index_head_dim=16, index_rope_dim=8)).eval()
    ids = torch.randint(0, 64, (2, 19))
    with torch.no_grad():
        full = model(ids).logits
        cache = DecodeCache(model.config.num_hidden_layers)
        steps = [model(ids[:, :7], past_key_values=cache), model(ids[:, 7:10], past_key_values=cache)]
        steps += [model(ids[:, t : t + 1], past_key_values=cache) for t in range(10, 19)]
    assert cache.layers[0]["k"].filled().shape[1] == 19 and cache.layers[0]["index_k"].filled().shape[1] == 19
    torch.testing.assert_close(torch.cat([s.logits for s in steps], 1), full, atol=1e-4, rtol=0)
    assert not any(s.aux_metrics for s in steps)  # no indexer loss / recall while decoding


def test_flops_per_token():
    cfg = tiny_config(topk=8)
    dsa, soft = DSAttention(cfg), SoftmaxAttention(cfg)
    H, D, d, H_I, d_I = 4, 8, 32, 4, 32
    for L in (4, 8, 100):
        index = 2 * d * (H_I * d_I + d_I + H_I) + 2 * H_I * (d_I + 1) * (L + 1) / 2
        keys = sum(min(8, t) for t in range(1, L + 1)) / L  # sparse: min(topk, t) keys at position t
        dense_core = 2 * 2 * H * D * (L + 1) / 2
        expected = soft.flops_per_token(L, "cpu") - dense_core + index + 2 * 2 * H * D * keys
        assert dsa.flops_per_token(L, "cpu") == pytest.approx(expected)
    warm = DSAttention(tiny_config(topk=8, stage="warmup"))
    index = 2 * d * (H_I * d_I + d_I + H_I) + 2 * H_I * (d_I + 1) * 50.5
    assert warm.flops_per_token(100, "cpu") == pytest.approx(soft.flops_per_token(100, "cpu") + index)


@pytest.mark.parametrize("options,match", [({"stage": "dense"}, "stage 'dense'"), ({"topk": 0}, "topk=0"),
                                           ({"index_rope_dim": 3}, "index_rope_dim=3"), ({"top_k": 4}, "top_k")])
def test_bad_options_raise(options, match):
    with pytest.raises(ValueError, match=match):
        DSAttention(tiny_config(**options))
