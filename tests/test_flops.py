"""FLOP counts (docs/configuration.md#what-a-count-includes): every registered mixer's `flops_per_token(seq_len,
"cpu")` against torch's FlopCounterMode over the mixer's own forward on CPU at two lengths that are not multiples
of any chunk, at its default options (chunk sizes included); the kernel path's chunk; and what a training step
charges to trained and frozen parts (runs/flops.py, the objectives' flops_schedule).

The counter sees mm / bmm / baddbmm / convolution. What it cannot see is counted here another way, said where:
in-place baddbmm_ and the triangular solve by formulas over the shapes the op passes (COUNTED_HERE); SDPA on
CPU and DSA's top-k indexer and sparse attention (numba) by swapping them for query-by-query references whose
matmuls it counts, after checking each reference gives the op's own output."""
import sys

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from model import DecoderLM, LMConfig
from model.mixers import softmax as softmax_module
from model.ops import kernels
from model.ops.kernels import repeat_heads
from model.registry import MIXERS
from runs.flops import TRAINED, part_costs, training_flops_per_token
from training.budget import StepCosts

pytestmark = pytest.mark.usefixtures("one_thread")
aten = torch.ops.aten
LENGTHS = (100, 200)  # past DSA's top-k (64), and not multiples of the chunks (32, 64): the padded last chunk counts


def solve_triangular_flops(a_shape, b_shape, *args, out_shape=None, upper=False, left=True, unitriangular=False,
                           **kwargs) -> int:
    """A X = B, A [..., m, m] unit-triangular, B [..., m, k]: m (m - 1) / 2 multiply-adds per column of B."""
    assert left and unitriangular, "counted for the unit-triangular solve from the left only"
    m, k = b_shape[-2], b_shape[-1]
    batch = torch.Size(torch.broadcast_shapes(a_shape[:-2], b_shape[:-2])).numel()
    return batch * k * m * (m - 1)


def inplace_baddbmm_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    b, n, m = a_shape
    return 2 * b * n * m * b_shape[-1]


COUNTED_HERE = {aten.baddbmm_: inplace_baddbmm_flops, aten.linalg_solve_triangular: solve_triangular_flops}


def counted_attend(q, k, v, segments=None, first_key=None):
    """Causal attention query by query over the keys it sees (the T queries are the last of k, v)."""
    assert segments is None and first_key is None
    Tq, Tk, H = q.shape[2], k.shape[2], q.shape[1]
    k, v = repeat_heads(k, H, dim=1), repeat_heads(v, H, dim=1)
    out = []
    for t in range(Tq):
        keys = Tk - Tq + t + 1
        scores = q[:, :, t:t + 1] @ k[:, :, :keys].transpose(-1, -2) * q.shape[-1] ** -0.5
        out.append(scores.softmax(-1) @ v[:, :, :keys])
    return torch.cat(out, 2)


def counted_index_topk(q_i, k_i, w, topk, offset=0, segment_ids=None):
    """The top-k keys of I[t, s] = sum_j w[t, j] relu(q_i[t, j] . k_i[s]) over the keys each query sees (batch 1)."""
    assert segment_ids is None and q_i.shape[0] == 1
    T, S = q_i.shape[1], k_i.shape[1]
    out = torch.full((1, T, min(topk, S)), -1, dtype=torch.long)
    for t in range(T):
        keys = offset + t + 1
        dots = (q_i[0, t] @ k_i[0, :keys].T).relu()  # [H_I, keys]
        scores = (w[0, t][None] @ dots)[0]
        picked = scores.topk(min(topk, keys)).indices
        out[0, t, :len(picked)] = picked
    return out


def counted_selected_attention(q, k, v, selection, scale=None, with_probs=False):
    """Attention of each query (batch 1) over its selected keys only."""
    assert q.shape[0] == 1 and not with_probs
    H = q.shape[2]
    out = []
    for t, row in enumerate(selection.indices[0]):
        keys = row[row >= 0]
        kt, vt = repeat_heads(k[0, keys], H, dim=1).transpose(0, 1), repeat_heads(v[0, keys], H, dim=1).transpose(0, 1)
        scores = q[0, t][:, None] @ kt.transpose(-1, -2) * q.shape[-1] ** -0.5  # [H, 1, keys]
        out.append((scores.softmax(-1) @ vt)[:, 0])
    return torch.stack(out)[None], None


@pytest.fixture
def references(monkeypatch):
    """The references in place of SDPA (in every mixer module that calls softmax's attend) and of DSA's numba ops;
    each checked against the op it stands for on the first call."""
    checked = set()

    def checking(name, reference, real, compare):
        def call(*args, **kwargs):
            got = reference(*args, **kwargs)
            if name not in checked:
                checked.add(name)
                with torch.no_grad():
                    compare(got, real(*args, **kwargs))
            return got
        return call

    close = lambda got, want: torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # noqa: E731
    same_sets = lambda got, want: torch.testing.assert_close(got.sort(-1).values, want.sort(-1).values)  # noqa: E731
    for name, module in list(sys.modules.items()):
        if name.startswith("model.mixers.") and getattr(module, "attend", None) is softmax_module.attend:
            monkeypatch.setattr(module, "attend", checking("attend", counted_attend, softmax_module.attend, close))
    from model.mixers import dsa

    monkeypatch.setattr(dsa, "index_topk", checking("index_topk", counted_index_topk, dsa.index_topk, same_sets))
    monkeypatch.setattr(dsa, "selected_attention", checking(
        "selected_attention", counted_selected_attention, dsa.selected_attention, lambda got, want: close(got[0], want[0])))
    return checked


def one_layer(name: str, **config) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(LMConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                              mixer=[name], **config)).eval()


def counted_forward_flops(mixer, T: int) -> float:
    x = torch.randn(1, T, mixer_width(mixer), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        mixer(x)  # the references check themselves against the real ops on their first call, outside the count
        with FlopCounterMode(display=False, custom_mapping=COUNTED_HERE) as counter:
            mixer(x)
    return counter.get_total_flops() / T


def mixer_width(mixer) -> int:
    return next(m.in_features for m in mixer.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("name", MIXERS.names())
def test_each_mixer_count_matches_its_counted_matmuls(name, references):
    """flops_per_token(T, "cpu") within 1% of the matmuls the mixer's forward runs on CPU, at two lengths (the
    count leaves out only elementwise work: Mamba2's D skip is the one elementwise term it includes). An op the
    counter cannot see and no reference stands for would leave its FLOPs out of the count, and fail here."""
    mixer = one_layer(name).layers[0].mixer
    for T in LENGTHS:
        counted = counted_forward_flops(mixer, T)
        assert mixer.flops_per_token(T, "cpu") == pytest.approx(counted, rel=0.01), f"{name} at T={T}"


def test_gdn_on_a_kernel_device_counts_the_kernel_chunk(monkeypatch):
    """Where fla's kernel runs (CPU tensors standing for CUDA ones, as tests/test_cuda_guards.py does), gdn's
    count is its op's counted matmuls at fla's chunk 64 rather than its own chunk_size option (32)."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    mixer = one_layer("gdn").layers[0].mixer
    at_64 = one_layer("gdn", mixer_options={"gdn": {"chunk_size": 64}}).layers[0].mixer
    counted = counted_forward_flops(at_64, 200)
    assert mixer.flops_per_token(200, "cpu") != pytest.approx(counted, rel=0.01)
    monkeypatch.setattr(kernels, "KERNEL_DEVICES", ("cpu",))
    assert mixer.flops_per_token(200, "cpu") == pytest.approx(counted, rel=0.01)


def test_step_costs_across_stages():
    """Two stages, 10 steps at 3 FLOPs/token then 2 FLOPs/token, 4 tokens a step."""
    costs = StepCosts([(0, 3.0), (10, 2.0)], 4)
    assert [costs.per_token(s) for s in (0, 9, 10, 50)] == [3.0, 3.0, 2.0, 2.0]
    assert costs.flops_through(5) == 60 and costs.flops_through(10) == 120 and costs.flops_through(15) == 160
    assert costs.steps_for(60) == 5 and costs.steps_for(160) == 15 and costs.steps_for(165) == 16  # 8 a step
    assert StepCosts([(0, 3.0)], 4).steps_for(61) == 5


def test_frozen_parts_are_charged_their_forward():
    """DSA's indexer warm-up (trainer.trainable=[indexer]): the main model 1x its forward, the indexer 3x."""
    lm = one_layer("dsa", mixer_options={"dsa": {"stage": "warmup"}})
    for n, p in lm.named_parameters():
        p.requires_grad_("indexer" in n)
    parts = lm.flops_by_part(128, "cpu")
    assert set(parts) == {"lm_head", "layers.0.mixer", "layers.0.mixer.indexer", "layers.0.ffn"}
    assert sum(parts.values()) == pytest.approx(lm.flops_per_token(128, "cpu"))
    indexer = lm.layers[0].mixer.indexer.flops_per_token(128, "cpu")
    assert parts["layers.0.mixer.indexer"] == indexer > 0
    assert training_flops_per_token(lm, 128, "cpu") == pytest.approx(lm.flops_per_token(128, "cpu") + 2 * indexer)
    lm.requires_grad_(True)
    assert training_flops_per_token(lm, 128, "cpu") == pytest.approx(TRAINED * lm.flops_per_token(128, "cpu"))


def test_a_self_critical_router_charges_the_models_evaluation_forward():
    """router=reinforce with baseline=self_critical runs the whole model once more without grad per training
    forward: charged 1x the model's forward on top of 3x, where another baseline adds nothing. What runs, by
    FlopCounterMode over a training forward and backward: self_critical's count less mean's is the count of
    one evaluation forward."""
    def reinforce_lm(baseline):
        return one_layer("softmax", ffn="moe", ffn_options={"moe": {
            "router": "reinforce", "num_experts": 4, "top_k": 2, "expert_intermediate_size": 32,
            "router_options": {"baseline": baseline}}}).train()

    def counted(step):
        with FlopCounterMode(display=False) as counter:
            step()
        return counter.get_total_flops()

    ids = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(0))
    critical, mean = reinforce_lm("self_critical"), reinforce_lm("mean")
    assert (critical.eval_forwards_per_step(), mean.eval_forwards_per_step()) == (1, 0)
    forward = critical.flops_per_token(64, "cpu")
    assert forward == mean.flops_per_token(64, "cpu")
    assert training_flops_per_token(critical, 64, "cpu") == pytest.approx((TRAINED + 1) * forward)
    assert training_flops_per_token(mean, 64, "cpu") == pytest.approx(TRAINED * forward)
    extra = counted(lambda: critical(ids, labels=ids).loss.backward()) - counted(lambda: mean(ids, labels=ids).loss.backward())
    with torch.no_grad():
        assert extra == counted(lambda: critical.eval()(ids)) > 0


def test_tied_lm_head_trains_with_the_embedding():
    """The lm_head of tied embeddings is charged as trained when the embedding trains (one parameter)."""
    lm = one_layer("softmax", tie_word_embeddings=True)
    lm.requires_grad_(False)
    lm.embed_tokens.weight.requires_grad_(True)
    costs = part_costs(lm, 64, "cpu")
    assert costs["lm_head"] == TRAINED * lm.flops_by_part(64, "cpu")["lm_head"]
    assert costs["layers.0.mixer"] == lm.flops_by_part(64, "cpu")["layers.0.mixer"]


def test_linearization_stages_charge_the_teacher_once_and_what_trains_thrice():
    """transfer: teacher forward (lm_head on one token) + student forward + each student mixer again (3x where
    the transfer trains it); distill: teacher forward + the student's step; finetune: the student's step."""
    from training.objectives.linearize.linearization import Linearization

    lc = OmegaConf.create({"transfer_steps": 2, "transfer_loss": "mse", "transfer_trains": "new",
                           "transfer_target": "mixer_core", "distill_steps": 2, "temperature": 1.0, "ce_weight": 0.0})
    teacher = one_layer("softmax").requires_grad_(False)
    student = one_layer("gdn", mixer_options={"gdn": {"expand_v": 1}})
    new = ["layers.0.mixer.a_proj.weight", "layers.0.mixer.b_proj.weight"]
    lin = Linearization(student, teacher, lc, new)
    T = 96
    t, s = teacher.flops_by_part(T, "cpu"), student.flops_by_part(T, "cpu")
    teacher_forward = sum(t.values()) - t["lm_head"] + t["lm_head"] / T
    assert lin.flops_per_token("transfer", T, "cpu") == pytest.approx(
        teacher_forward + sum(s.values()) + TRAINED * s["layers.0.mixer"])
    assert lin.flops_per_token("distill", T, "cpu") == pytest.approx(sum(t.values()) + TRAINED * sum(s.values()))
    assert lin.flops_per_token("finetune", T, "cpu") == pytest.approx(TRAINED * sum(s.values()))
