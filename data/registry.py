from common.registry import Registry

DATASETS = Registry("data")


def build_data(cfg, seq_len: int, seed: int):
    """Build the Data for cfg.name (one of DATASETS.names(); data/__init__ registers them)."""
    return DATASETS.get(cfg.name)(cfg, seq_len, seed)
