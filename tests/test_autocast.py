"""Every mixer and the MoE under bf16 autocast (`torch.autocast("cpu", torch.bfloat16)`, as a GPU run
trains under CUDA autocast) with document positions, forward and backward. Spies on each op's entry point
(where the GPU kernel is called) record the dtypes it receives and returns: the kernel inputs must arrive
in bf16 (a promotion to fp32 on the way would make the GPU kernel run in fp32), the gates and states in
fp32; the PyTorch forms behind them must run with autocast off, in fp32 (autocast inside would run their
matmuls in bf16 and hand bf16 to ops without a bf16 kernel). One token of cached decoding too."""
import inspect

import pytest
import torch

import model.ffn.moe as moe
import model.mixers.delta_rule as delta_rule_mixer
import model.mixers.derived_gdn as derived_gdn_mixer
import model.mixers.dsa as dsa_mixer
import model.mixers.linear as linear_mixer
import model.mixers.mamba2 as mamba2_mixer
import model.ops.gated_delta.chunk as gated_delta
import model.ops.gated_delta.derived as derived_rule
import model.ops.linear_attention.chunk as linear_attention
import model.ops.ssd.chunk as ssd
from model import DecoderLM, LMConfig

pytestmark = pytest.mark.usefixtures("one_thread")

BF16, FP32 = torch.bfloat16, torch.float32
T = 40
# Row 0 holds documents of 15 and 25 tokens; row 1 starts mid-document (positions 5..14), then one of 30.
POSITIONS = torch.stack([torch.cat([torch.arange(15), torch.arange(25)]),
                         torch.cat([torch.arange(5, 15), torch.arange(30)])])
OPTIONS = {"mamba2": {"head_dim": 16, "state_size": 16, "chunk_size": 16}, "gdn": {"chunk_size": 16},
           "linear": {"chunk_size": 16}, "dsa": {"topk": 8, "index_head_dim": 16, "index_rope_dim": 8}}


class Spy:
    """Wraps `module.name` for the test: each call records its arguments' dtypes by parameter name (tensors;
    None for an argument not given), its tensor outputs' dtypes and whether CPU autocast was on inside."""

    def __init__(self, monkeypatch, module, name: str, params: tuple[str, ...] | None = None):
        self.name, self.calls = f"{module.__name__}.{name}", []
        original = getattr(module, name)
        self.params = params or tuple(inspect.signature(original).parameters)

        def spied(*args, **kwargs):
            given = dict(zip(self.params, args), **kwargs)
            out = original(*args, **kwargs)
            outs = out if isinstance(out, tuple) else (out,)
            self.calls.append({"args": {k: v.dtype for k, v in given.items() if torch.is_tensor(v)},
                               "given": set(given), "outs": [o.dtype for o in outs if torch.is_tensor(o)],
                               "autocast": torch.is_autocast_enabled("cpu")})
            return out

        monkeypatch.setattr(module, name, spied)

    def expect(self, dtypes: dict, out: torch.dtype | None = None, autocast: bool | None = None, given=()):
        assert self.calls, f"{self.name} was not called"
        for call in self.calls:
            got = {k: call["args"].get(k) for k in dtypes}
            assert got == dtypes, f"{self.name} received {got}, expected {dtypes}"
            if out is not None:
                assert call["outs"][0] == out, f"{self.name} returned {call['outs'][0]}, expected {out}"
            if autocast is not None:
                assert call["autocast"] == autocast, f"{self.name}: autocast {'on' if call['autocast'] else 'off'} inside"
            assert set(given) <= call["given"], f"{self.name} was not given {set(given) - call['given']}"


def build(mixer: str, ffn: str = "dense") -> DecoderLM:
    torch.manual_seed(0)
    config = LMConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, mixer=mixer, ffn=ffn, mixer_options=OPTIONS,
                      ffn_options={"moe": {"num_experts": 4, "top_k": 2, "expert_intermediate_size": 32}})
    return DecoderLM(config)


def train_step_bf16(model: DecoderLM) -> None:
    """Forward under CPU bf16 autocast with document positions, backward outside it; every parameter
    that the step reaches gets a finite fp32 gradient."""
    ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", BF16):
        out = model(ids, labels=ids, position_ids=POSITIONS, use_cache=False)
    assert out.logits.dtype == BF16
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == FP32 and g.isfinite().all() for g in grads)


def decode_bf16(model: DecoderLM) -> None:
    """A prompt and one cached token under autocast (the recurrent / single-step forms)."""
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", BF16):
        out = model(ids[:, :8], use_cache=True)
        model(ids[:, 8:], past_key_values=out.past_key_values, use_cache=True)


def test_softmax(monkeypatch):
    sdpa = Spy(monkeypatch, torch.nn.functional, "scaled_dot_product_attention", ("query", "key", "value", "attn_mask"))
    train_step_bf16(build("softmax"))
    sdpa.expect({"query": BF16, "key": BF16, "value": BF16, "attn_mask": torch.bool}, out=BF16)


def test_gdn(monkeypatch):
    """The short conv's document-boundary correction keeps q, k, v in bf16 (it promoted them to fp32 under
    CUDA autocast, and failed under CPU autocast)."""
    op = Spy(monkeypatch, delta_rule_mixer, "chunk_gated_delta_rule")
    core = Spy(monkeypatch, gated_delta._ChunkedGatedDelta, "apply", ("q", "k", "v", "g", "beta", "S0"))
    train_step_bf16(model := build("gdn"))
    op.expect({"q": BF16, "k": BF16, "v": BF16, "g": FP32, "beta": FP32}, out=BF16, given=("cu_seqlens",))
    core.expect({"q": FP32, "k": FP32, "v": FP32, "g": FP32, "beta": FP32, "S0": FP32}, autocast=False)
    step = Spy(monkeypatch, delta_rule_mixer, "fused_recurrent_gated_delta_rule")
    decode_bf16(model)
    step.expect({"q": BF16, "k": BF16, "v": BF16, "g": FP32, "beta": FP32, "initial_state": FP32}, out=BF16)


def test_derived_gdn(monkeypatch):
    """The PyTorch gated delta rule runs in fp32 with autocast off (under autocast its triangular solve got
    bf16, which has no kernel); the rule itself gets q, k, v in bf16, as the fla kernel would."""
    op = Spy(monkeypatch, derived_gdn_mixer, "derived_gated_delta_rule")
    rule = Spy(monkeypatch, derived_rule, "chunk_gated_delta_rule")
    core = Spy(monkeypatch, gated_delta._ChunkedGatedDelta, "apply", ("q", "k", "v", "g", "beta", "S0"))
    train_step_bf16(model := build("derived_gdn"))
    op.expect({"q": BF16, "k": BF16, "v": BF16}, out=BF16, given=("cu_seqlens",))
    rule.expect({"q": BF16, "k": BF16, "v": BF16, "g": FP32, "beta": FP32}, out=BF16, autocast=False)
    core.expect({"q": FP32, "k": FP32, "v": FP32, "g": FP32, "beta": FP32, "S0": FP32}, autocast=False)
    op.calls.clear()
    decode_bf16(model)
    op.expect({"q": BF16, "k": BF16, "v": BF16}, out=BF16)


def test_mamba2(monkeypatch):
    """x, B, C reach the SSD in bf16 through the document-corrected conv; its scan runs in fp32."""
    op = Spy(monkeypatch, mamba2_mixer, "mamba_chunk_scan")
    core = Spy(monkeypatch, ssd, "chunk_scalar_decay")
    train_step_bf16(model := build("mamba2"))
    op.expect({"x": BF16, "dt": BF16, "A": FP32, "B": BF16, "C": BF16}, out=BF16, given=("cu_seqlens",))
    core.expect({"q": FP32, "k": FP32, "v": FP32, "g": FP32}, autocast=False)
    step = Spy(monkeypatch, mamba2_mixer, "mamba_state_step")
    decode_bf16(model)
    step.expect({"x": BF16, "B": BF16, "C": BF16, "state": FP32}, out=BF16)


def test_linear(monkeypatch):
    op = Spy(monkeypatch, linear_mixer, "chunk_linear_attn")
    core = Spy(monkeypatch, linear_attention, "chunk_scalar_decay")
    train_step_bf16(build("linear"))
    op.expect({"q": BF16, "k": BF16, "v": BF16}, out=BF16, given=("cu_seqlens",))
    core.expect({"q": FP32, "k": FP32, "v": FP32}, autocast=False)


def test_dsa(monkeypatch):
    """The sparse stage (T > topk): attention over the selection and the indexer get the bf16 projections."""
    attention = Spy(monkeypatch, dsa_mixer, "selected_attention")
    topk = Spy(monkeypatch, dsa_mixer, "index_topk")
    train_step_bf16(build("dsa"))
    attention.expect({"q": BF16, "k": BF16, "v": BF16}, out=BF16)
    topk.expect({"q_i": BF16, "w": BF16}, given=("segment_ids",))


def test_moe(monkeypatch):
    """The experts run in bf16 (the dtype torch._grouped_mm takes on CUDA)."""
    experts = Spy(monkeypatch, moe.ExpertsLoop, "apply", ("xs", "w_gu", "w_d"))
    train_step_bf16(build("softmax", ffn="moe"))
    experts.expect({"xs": BF16, "w_gu": BF16, "w_d": BF16}, out=BF16)
