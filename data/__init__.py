"""Data: every source ends as packed token blocks [N, seq_len] for train and val.

    data = build_data(cfg.data, seq_len, seed)   # -> Data
    data.train.input_ids, data.val.input_ids, data.tokenizer, data.bytes_per_token

Sources (cfg.data.name): `stdlib` (the default embedded corpus: this Python's standard library
source), `hf` (any hub dataset), `local` (.txt/.jsonl/.parquet files), `mqar` (synthetic recall),
`state_tracking` (synthetic group word problems).
"""
from data.registry import DATASETS, build_data
from data.types import Data, Split
from data import mqar, state_tracking, text  # noqa: F401  (importing a source module registers it)

__all__ = ["Data", "Split", "DATASETS", "build_data"]
