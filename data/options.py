"""data.* of a train.py or eval.py config: each key's Rule (common/validation.py) and the checks between keys.
State tracking's own keys and check are beside it (data/state_tracking.py)."""
from common.validation import FLAG, FRACTION, Problems, Rule, positive
from data import state_tracking

RULES = {
    "data.vocab_size": Rule(int, at_least=4),
    # the text sources' (data/text.py)
    "data.val_fraction": FRACTION,
    "data.max_documents": positive(nullable=True),
    "data.max_tokens": positive(nullable=True),
    "data.document_mask": FLAG,
    "data.num_proc": positive(nullable=True),
    "data.bpe_train_bytes": positive(nullable=True),
    "data.cache_shared": FLAG,
    "data.streaming": FLAG,
    # MQAR's (data/mqar.py), [] standing for any index of a list
    "data.power_a": Rule(float, above=0),
    **{f"data.{split}[].{field}": rule for split in ("train", "test")
       for field, rule in (("seq_len", Rule(int, at_least=2)), ("num_kv_pairs", positive()), ("num_examples", positive()))},
    **state_tracking.RULES,
}


def cross_checks(config: dict, problems: Problems) -> None:
    """State tracking's test length against the model's, then a BPE vocabulary that holds the byte tokens."""
    state_tracking.cross_checks(config, problems)
    data = config["data"]
    if problems.fine("data.vocab_size") and data.get("tokenizer") == "bpe" and data["vocab_size"] < 257:
        problems.add(f"data.vocab_size={data['vocab_size']}; valid: >= 257 with data.tokenizer=bpe "
                     f"(its 256 byte tokens and EOS)")
