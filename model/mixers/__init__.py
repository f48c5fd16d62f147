"""Sequence mixers. Interface, shared by every mixer:

    mixer = MixerClass(config: LMConfig, layer_idx: int)
    y = mixer(x [B, T, D], cache: dict | None = None, aux: AuxCollector | None = None,
              segments: DocumentSegments | None = None)  # [B, T, D]

`cache` is a dict the layer owns across decoding calls: the model sets `cache["offset"]` (tokens
already processed) before each call and the mixer keeps whatever continuation needs in it (KV for
softmax/DSA; conv + recurrent state for the linear mixers). `aux` receives optional losses/metrics.
`segments` (model/segments.py, document masking of a packed training batch, never with a cache): each
token must see only its own document segment.
Options: a mixer that has any declares them as a dataclass in its file (`Options`, fields from
model/options.py `option`) and reads them with `config.options_for_mixer(name, Options)`, which checks
them in one place (model/options.py parse_options). Each mixer defines `flops_per_token(seq_len, device)` (forward, multiply-add = 2 FLOPs, on the path
its ops take on that device), which DecoderLM.flops_per_token calls for every layer (budget, MFU). The whole contract: docs/extending.md.
"""
import importlib
import pkgutil

from model.registry import MIXERS

# Import every mixer module so that its @MIXERS.register runs.
for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["MIXERS"]
