"""LMConfig: a transformers PretrainedConfig with HF field names plus the per-layer block kinds."""
from dataclasses import dataclass

from transformers import PretrainedConfig

from common.validation import Problems, Rule, positive
from model.options import block_problems, parse_options


@dataclass(frozen=True)
class Parametrization:
    """How a model starts around and between its blocks' own inits: the token embedding, the output layer,
    and the scale of every projection that writes into the residual stream (model/layers.py residual_scale).
    docs/blocks.md#parametrization has the measurements behind each."""
    tied: bool                   # lm_head shares the embedding matrix; else its own N(0, initializer_range)
    unit_embedding: bool         # the embedding N(0, 1/hidden_size) (each token's vector about unit norm); else
                                 # N(0, initializer_range)
    rescale_residual: bool       # residual writes' init times 1/sqrt(2 L) (GPT-2); else as the block draws it
    ffn_starts_at_zero: bool     # every FFN's residual write starts at 0: a layer starts as its mixer alone


PARAMETRIZATIONS = {
    "llama": Parametrization(tied=False, unit_embedding=False, rescale_residual=False, ffn_starts_at_zero=False),
    "fla": Parametrization(tied=False, unit_embedding=False, rescale_residual=True, ffn_starts_at_zero=False),
    "tied": Parametrization(tied=True, unit_embedding=False, rescale_residual=True, ffn_starts_at_zero=False),  # GPT-2, mamba_ssm
    # transformers' Mamba2 (tied, no FFN in its layers), with the embedding at N(0, 1/d) where it draws N(0, 0.1)
    "mamba2": Parametrization(tied=True, unit_embedding=True, rescale_residual=True, ffn_starts_at_zero=True),
}
# Each layer's mixer declares one (its `parametrization`); mixers that disagree: "llama". experiment=mqar's; the
# default stays "tied", which the default corpus run measured better (docs/blocks.md#parametrization).
PER_MIXER = "per_mixer"
UNDECLARED_PARAMETRIZATION = "llama"  # per_mixer's for a mixer that declares none (it starts as attention)


# model.* of a train.py config (common/validation.py); the blocks' names and options: model/options.py
RULES = {
    "model.hidden_size": positive(),
    "model.num_hidden_layers": positive(),
    "model.num_attention_heads": positive(),
    "model.num_key_value_heads": positive(nullable=True),
    "model.intermediate_size": positive(nullable=True),
    "model.max_position_embeddings": Rule(int, at_least=2),
    "model.parametrization": Rule(str, choices=(PER_MIXER, *PARAMETRIZATIONS)),
    "model.tie_word_embeddings": Rule(bool, nullable=True),  # null: the parametrization's
}


def cross_checks(config: dict, problems: Problems) -> None:
    """The blocks (model/options.py block_problems), then the head counts against the width and each other."""
    problems.lines += block_problems(config)
    m = config["model"]
    if (problems.fine("model.hidden_size", "model.num_attention_heads")
            and m["hidden_size"] % m["num_attention_heads"]):
        problems.add(f"model.hidden_size={m['hidden_size']} does not split into model.num_attention_heads="
                     f"{m['num_attention_heads']} heads; valid: a multiple of {m['num_attention_heads']}",
                     "model.hidden_size", "model.num_attention_heads")
    if (problems.fine("model.num_key_value_heads", "model.num_attention_heads") and m["num_key_value_heads"]
            and m["num_attention_heads"] % m["num_key_value_heads"]):
        problems.add(f"model.num_key_value_heads={m['num_key_value_heads']}; valid: a divisor of "
                     f"model.num_attention_heads={m['num_attention_heads']}")

class LMConfig(PretrainedConfig):
    model_type = "swaplm"

    def __init__(
        self,
        vocab_size: int = 8192,
        hidden_size: int = 256,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        intermediate_size: int | None = None,
        max_position_embeddings: int = 2048,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        parametrization: str = "tied",
        tie_word_embeddings: bool | None = None,
        mixer: str | list[str] = "softmax",
        ffn: str | list[str] = "dense",
        mixer_options: dict | None = None,
        ffn_options: dict | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        # SwiGLU width: 8/3 d rounded up to a multiple of 64 (Llama's rule) unless given.
        self.intermediate_size = intermediate_size or 64 * ((8 * hidden_size // 3 + 63) // 64)
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        if parametrization != PER_MIXER and parametrization not in PARAMETRIZATIONS:
            raise ValueError(f"parametrization={parametrization!r}; valid: {', '.join([PER_MIXER, *PARAMETRIZATIONS])}")
        self.parametrization = parametrization
        # A name applies to every layer; a list gives one name per layer (hybrid schedules).
        mixer = kwargs.pop("attention", mixer)  # a config.json saved when `mixer` was called `attention`
        self.mixer = list(mixer) if not isinstance(mixer, str) else mixer
        self.ffn = list(ffn) if not isinstance(ffn, str) else ffn
        # Per-kind options, keyed by mixer / FFN name: {"gdn": {"conv_size": 4}, ...}.
        self.mixer_options = dict(mixer_options or {})
        self.ffn_options = dict(ffn_options or {})
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if tie_word_embeddings is None:  # the parametrization's; given (as every saved config.json does), it wins
            tie_word_embeddings = self.parametrization_rule().tied
        super().__init__(
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            **kwargs,
        )

    def _per_layer(self, value, what: str) -> list[str]:
        if isinstance(value, str):
            return [value] * self.num_hidden_layers
        if len(value) != self.num_hidden_layers:
            raise ValueError(
                f"{what} lists {len(value)} layers but num_hidden_layers={self.num_hidden_layers}"
            )
        return list(value)

    @property
    def layer_mixers(self) -> list[str]:
        return self._per_layer(self.mixer, "mixer")

    @property
    def layer_ffns(self) -> list[str]:
        return self._per_layer(self.ffn, "ffn")

    def parametrization_rule(self) -> Parametrization:
        """The Parametrization this config names; per_mixer: the one every layer's mixer declares (a mixer that
        declares none: UNDECLARED_PARAMETRIZATION), llama if they disagree (a hybrid with attention layers starts
        as attention wants: docs/blocks.md#parametrization)."""
        name = self.parametrization
        if name == PER_MIXER:
            from model.mixers import MIXERS

            declared = {getattr(MIXERS.get(m), "parametrization", UNDECLARED_PARAMETRIZATION) for m in self.layer_mixers}
            name = declared.pop() if len(declared) == 1 else "llama"
        return PARAMETRIZATIONS[name]

    def options_for_mixer(self, name: str, options_class):
        """The `name` mixer's options (an `options_class`) from mixer_options[name]; bad ones are a one-line error."""
        return parse_options(name, options_class, self.mixer_options.get(name))

    def options_for_ffn(self, name: str, options_class):
        return parse_options(name, options_class, self.ffn_options.get(name))
