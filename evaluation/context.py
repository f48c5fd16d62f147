"""What every eval suite is handed (EvalContext: the model, its data and the training length), and the
rule for sequences past max_position_embeddings, which DecoderLM refuses.

A model with rotary positions (softmax, dsa, derived_gdn and linear apply softmax attention's rotary) is
not measured past the bound: that length is skipped with the reason. A model without positions (every
layer gdn or mamba2) has nothing the bound protects and is measured at any length (positions_up_to lifts
it for the measurement). A suite that measures cost on random tokens (decode) lifts it for every model:
rotary is computed per call, so positions past the bound do not change the cost."""
from contextlib import contextmanager
from dataclasses import dataclass

from data.types import Data, Split


@dataclass
class EvalContext:
    lm: object             # the DecoderLM, in eval mode
    data: Data             # the data it is evaluated on (its val split, tokenizer, bytes per token)
    data_cfg: object       # that data's config (data/ builds it again at other lengths)
    train_seq_len: int     # the length the model was trained at
    device: object
    seed: int
    batch_size: int        # sequences per forward at the training length
    title: str             # how plots name the model (<run>/final)

    def val_at(self, length: int) -> Split:
        """The val split in blocks of `length` tokens (ValueError for synthetic data, which has no text)."""
        from data import build_data

        if self.data.tokenizer is None:  # MQAR: only query labels; the recall suite measures it at longer seq_len
            raise ValueError("synthetic data (no text to score)")
        return build_data(self.data_cfg, length, self.seed).val


def too_long(lm, length: int) -> str | None:
    """Why `length` tokens cannot be measured on this model, or None: past max_position_embeddings with
    a layer that applies rotary positions (the mixers holding softmax attention's projections carry `rotary`:
    model/mixers/attention_projections.py)."""
    limit = lm.config.max_position_embeddings
    rotary = sorted({name for name, block in zip(lm.config.layer_mixers, lm.layers) if hasattr(block.mixer, "rotary")})
    if length > limit and rotary:
        return f"{length} tokens exceed max_position_embeddings={limit} (rotary positions in {', '.join(rotary)})"
    return None


@contextmanager
def positions_up_to(lm, length: int):
    """DecoderLM refuses sequences past max_position_embeddings; lift that bound to `length` for the
    measurement (too_long has already refused the models with positions)."""
    limit = lm.config.max_position_embeddings
    lm.config.max_position_embeddings = max(limit, length)
    try:
        yield
    finally:
        lm.config.max_position_embeddings = limit


def first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
