from model.registry import Registry

DATASETS = Registry("data")


def build_data(cfg, seq_len: int, seed: int):
    """Build the Data for cfg.name (one of DATASETS.names()). Importing the source modules here
    registers them."""
    import data.mqar  # noqa: F401
    import data.text  # noqa: F401

    return DATASETS.get(cfg.name)(cfg, seq_len, seed)
