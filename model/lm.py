"""DecoderLM: embed -> [x + mixer(norm(x)); x + ffn(norm(x))] x L -> norm -> lm_head.

A transformers PreTrainedModel, so save_pretrained / from_pretrained / generate / lm-eval work.
Each layer's mixer and FFN come from the registries by the names in LMConfig.mixer / .ffn.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutputWithPast

from model.config import LMConfig
from model.ffn import FFNS
from model.layers import AuxCollector, KVBuffer, RMSNorm, at_least_fp32
from model.segments import DocumentSegments
from model.mixers import MIXERS


def held_bytes(value) -> int:
    """Bytes a decode cache entry holds: a KVBuffer's filled part, a tensor's elements; nothing for the rest (offset)."""
    if isinstance(value, KVBuffer):
        return value.nbytes()
    return value.numel() * value.element_size() if torch.is_tensor(value) else 0


class DecodeCache:
    """Per-layer state for incremental decoding: one dict per layer, filled by its mixer.

    Softmax layers keep K/V (grows with the sequence); linear mixers keep a fixed-size conv and
    recurrent state. Passed to generate as `past_key_values`.
    """

    is_compileable = False  # generate asks before choosing to auto-compile

    def __init__(self, num_layers: int):
        self.layers: list[dict] = [{} for _ in range(num_layers)]
        self.seen_tokens = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for layer in self.layers:
            for key, value in layer.items():
                if isinstance(value, KVBuffer):
                    value.reorder(beam_idx)
                elif torch.is_tensor(value) and value.dim() > 0:
                    layer[key] = value.index_select(0, beam_idx.to(value.device))

    def layer_nbytes(self) -> list[int]:
        """Bytes of what each layer keeps (K/V, conv tails, recurrent states)."""
        return [sum(held_bytes(v) for v in layer.values()) for layer in self.layers]

    def nbytes(self) -> int:
        return sum(self.layer_nbytes())


@dataclass
class LMOutput(CausalLMOutputWithPast):
    lm_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    aux_metrics: dict | None = None


class Block(nn.Module):
    def __init__(self, config: LMConfig, layer_idx: int):
        super().__init__()
        self.mixer_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = MIXERS.get(config.layer_mixers[layer_idx])(config, layer_idx)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = FFNS.get(config.layer_ffns[layer_idx])(config, layer_idx)

    def forward(self, x: torch.Tensor, cache: dict | None, aux: AuxCollector,
                segments: DocumentSegments | None = None, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x), cache, aux, segments)
        return x + self.ffn(self.ffn_norm(x), aux, input_ids, None if segments is None else segments.real)


class DecoderLM(PreTrainedModel, GenerationMixin):
    config_class = LMConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"lm_head.weight": "embed_tokens.weight"}

    def __init__(self, config: LMConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    # transformers plumbing -------------------------------------------------------------------
    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # our DecodeCache is created in forward, not a transformers DynamicCache

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def _init_weights(self, module: nn.Module) -> None:
        """Blocks init themselves: a module that defines `init_parameters()` (every mixer, FFN and norm)
        initialises its own parameters as its reference does (model/layers.py). What no block owns is
        initialised here, as the config's parametrization says (model/config.py): the embedding N(0, 1/d)
        or N(0, initializer_range), an untied lm_head N(0, initializer_range). transformers applies this to
        every module, submodules first, and skips loaded weights."""
        if hasattr(module, "init_parameters"):
            module.init_parameters()
        elif isinstance(module, nn.Embedding):
            unit = self.config.parametrization_rule().unit_embedding
            std = self.config.hidden_size ** -0.5 if unit else self.config.initializer_range
            init.normal_(module.weight, mean=0.0, std=std)
        elif module is self.lm_head:
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)

    def _initialize_weights(self, module: nn.Module, is_custom_code: bool = False) -> None:
        # As transformers' own models: our _init_weights writes only through transformers.initialization,
        # which skips loaded tensors. Its custom-code shortcut (a module counts as initialised when all its
        # direct parameters are) would skip every block that holds its parameters in submodules.
        super()._initialize_weights(module, is_custom_code=False)

    # forward ---------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.LongTensor,
        labels: torch.LongTensor | None = None,
        past_key_values: DecodeCache | None = None,
        use_cache: bool | None = None,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        position_ids: torch.LongTensor | None = None,
        context=None,
        **kwargs,
    ) -> LMOutput:
        """labels follow the transformers convention: aligned with input_ids and shifted here, so
        position t predicts labels[t + 1]; -100 is ignored.

        attention_mask [B, S] (1 at a real token; S = the cache's tokens and this call's): a padded batch, each
        row's real tokens one run with pads to its left or right (DocumentSegments.padded): no pad reaches a real
        token's output, rotary counts real tokens only, MoE layers route real tokens only, and no pad is a target
        of the loss. With a decode cache, pad on the left (the cache continues each row after its last token):
        greedy generate on a left-padded batch then gives what each prompt gives alone.

        position_ids [B, T] (document masking of a packed batch): 0 at the first token of each
        document segment, +1 within it; t = 0 always starts a segment. Each token then sees only its
        own segment: attention is block-causal, recurrent states and short convs restart, rotary runs
        at these positions. Ignored while decoding with a cache (generate passes arange positions).

        context (model/ops/context_parallel.py ContextGroup; context parallelism, training and scoring only): the
        input_ids, labels and position_ids are the whole rows, on every rank of the group, and this rank runs
        its slice [start, end) of them (`context.bounds(T)`): logits are the slice's [B, end - start, V], the
        losses those of the whole rows (the slices' sums added over the group), as one process's."""
        segments, T = None, input_ids.shape[1]  # the whole rows' length, context parallel or not
        padded = attention_mask is not None and not bool(attention_mask.all())
        if padded:
            segments = self.padded_segments(attention_mask, position_ids, past_key_values, use_cache, context, T)
        elif context is not None:
            if past_key_values is not None or use_cache:
                raise ValueError("context parallelism runs whole sequences: no decode cache")
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)
            segments = DocumentSegments(position_ids, context)
            input_ids = input_ids[:, segments.start:segments.end]
        elif position_ids is not None and past_key_values is None and not use_cache:
            segments = DocumentSegments(position_ids)
        if past_key_values is None and use_cache:
            past_key_values = DecodeCache(self.config.num_hidden_layers)
        offset = past_key_values.seen_tokens if past_key_values is not None else 0
        if offset + T > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {offset + T} exceeds max_position_embeddings={self.config.max_position_embeddings}"
            )
        aux = AuxCollector(context)
        x = self.hidden_states(input_ids, aux, segments, past_key_values, offset)
        if past_key_values is not None:
            past_key_values.seen_tokens = offset + T
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self.lm_head(x)

        loss = lm_loss = aux_loss = None
        if labels is not None:
            # Shift the labels, not the logits: position t predicts labels[t + 1]; the last position
            # gets -100. Slicing the logits instead would copy the whole [B, T, V] tensor.
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)
            if padded:  # a pad neither predicts nor is predicted
                real = segments.real if segments is not None else attention_mask[:, -T:].bool()
                targets = targets.masked_fill(~(real & F.pad(real[:, 1:], (0, 1))), -100)
            flat = at_least_fp32(logits.flatten(0, 1))
            if context is None:
                targets = targets.flatten()
                lm_loss = F.cross_entropy(flat, targets, ignore_index=-100)
            else:  # the slice's share of the mean over the whole rows' labelled tokens, added over the slices
                labelled = (targets != -100).sum()
                targets = targets[:, segments.start:segments.end].flatten()
                lm_loss = context.total(F.cross_entropy(flat, targets, ignore_index=-100, reduction="sum")) / labelled
            keep = real.flatten() if padded else slice(None)  # the tokens the MoE layers routed: the real ones
            aux.give_token_loss(lambda: F.cross_entropy(flat.detach(), targets, ignore_index=-100, reduction="none")[keep],
                                (targets != -100)[keep], lambda: self.eval_token_loss(input_ids, segments, targets)[keep])
            aux_loss = aux.total_loss()
            loss = lm_loss if aux_loss is None else lm_loss + aux_loss
        return LMOutput(
            loss=loss, logits=logits, past_key_values=past_key_values,
            lm_loss=lm_loss, aux_loss=aux_loss, aux_metrics=aux.summary(),
        )

    @staticmethod
    def padded_segments(attention_mask, position_ids, past_key_values, use_cache, context, T: int):
        """The segments of a padded call (forward's docstring), or None on a decode cache's later calls, whose tokens
        must all be real (the cache then holds each row's start: DocumentSegments.last_start)."""
        if context is not None:
            raise ValueError("attention_mask has padding under context parallelism, which runs packed rows only")
        if attention_mask.shape[1] < T:
            raise ValueError(f"attention_mask covers {attention_mask.shape[1]} tokens of a call of {T}")
        if past_key_values is None and not use_cache:
            if attention_mask.shape[1] != T:
                raise ValueError(f"attention_mask covers {attention_mask.shape[1]} tokens, input_ids {T}")
            return DocumentSegments.padded(attention_mask, position_ids)
        if past_key_values is not None and past_key_values.seen_tokens:
            if not bool(attention_mask[:, -T:].all()):
                raise ValueError("attention_mask pads tokens after the first call with this decode cache; only a "
                                 "prompt may be padded, on the left")
            return None
        right = (~attention_mask[:, -1].bool()).nonzero()[:, 0].tolist()
        if right:
            raise ValueError(f"attention_mask pads the right of row(s) {', '.join(map(str, right))} with a decode "
                             "cache, which continues each row after its last token: pad on the left "
                             "(padding_side='left')")
        return DocumentSegments.padded(attention_mask, position_ids)

    def hidden_states(self, input_ids: torch.Tensor, aux: AuxCollector | None, segments: DocumentSegments | None,
                      past_key_values: DecodeCache | None = None, offset: int = 0) -> torch.Tensor:
        """The embedding, the blocks and the final norm: [B, T, d] before lm_head."""
        x = self.embed_tokens(input_ids)
        for i, block in enumerate(self.layers):
            cache = None
            if past_key_values is not None:
                cache = past_key_values.layers[i]
                cache["offset"] = offset
            x = block(x, cache, aux, segments, input_ids)
        return self.norm(x)

    @torch.no_grad()
    def eval_token_loss(self, input_ids: torch.Tensor, segments: DocumentSegments | None,
                        targets: torch.Tensor) -> torch.Tensor:
        """Each token's loss [B T] (no grad) when the same batch goes through the model in evaluation
        mode (router=reinforce routing greedily, as evaluation and decoding do): the self-critical
        baseline's reward. The blocks in sequence as in forward, without re-entering forward."""
        was_training = self.training
        self.train(False)
        try:
            logits = self.lm_head(self.hidden_states(input_ids, None, segments))
        finally:
            self.train(was_training)
        return F.cross_entropy(at_least_fp32(logits.flatten(0, 1)), targets, ignore_index=-100, reduction="none")

    # accounting ------------------------------------------------------------------------------
    def flops_per_token(self, seq_len: int, device) -> float:
        """Forward FLOPs per token of the model as built, on the path its ops take on `device` ("cpu", "cuda";
        active experts only). Training charges each part by whether it trains (runs/flops.py)."""
        return float(sum(self.flops_by_part(seq_len, device).values()))

    def flops_by_part(self, seq_len: int, device) -> dict[str, float]:
        """Forward FLOPs per token by the module that spends them, keyed by module name: "lm_head", each layer's
        "layers.<i>.mixer" and "layers.<i>.ffn", and apart from its mixer's rest a mixer's child module that
        counts its own (has `flops_per_token(seq_len, device)`: DSA's indexer). The embedding lookup costs none."""
        parts = {"lm_head": 2 * self.config.hidden_size * self.config.vocab_size}
        for i, block in enumerate(self.layers):
            name, rest = f"layers.{i}.mixer", block.mixer.flops_per_token(seq_len, device)
            for child, module in block.mixer.named_children():
                if hasattr(module, "flops_per_token"):
                    parts[f"{name}.{child}"] = module.flops_per_token(seq_len, device)
                    rest -= parts[f"{name}.{child}"]
            parts[name] = rest
            parts[f"layers.{i}.ffn"] = block.ffn.flops_per_token()
        return parts

    def eval_forwards_per_step(self) -> int:
        """Whole-model forwards in evaluation mode (no grad) that a training forward runs beside its own: 1 where
        a block asks for each token's loss under it (`needs_eval_forward`: router=reinforce's self-critical
        baseline, eval_token_loss), else 0."""
        return int(any(getattr(m, "needs_eval_forward", False) for m in self.modules()))

    @property
    def may_leave_parameters_unused(self) -> bool:
        """True if a training step may leave some parameter without a gradient (a block declares it with the same
        name), so DDP must search the graph for unused parameters."""
        return any(getattr(m, "may_leave_parameters_unused", False) for m in self.modules() if m is not self)

    def parameter_counts(self) -> dict[str, int]:
        """Total parameters, and active ones per token (MoE counts only routed-to experts)."""
        total = sum(p.numel() for p in self.parameters())
        inactive = sum(getattr(b.ffn, "inactive_parameters", lambda: 0)() for b in self.layers)
        return {"total": total, "active": total - inactive}
