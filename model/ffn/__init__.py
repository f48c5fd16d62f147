"""Feed-forward blocks. Interface: `ffn = FFNClass(config, layer_idx)`;
`y = ffn(x [B, T, D], aux=None, token_ids=None)` (token_ids [B, T]: the input ids of x's tokens, which
the model always passes; MoE's hash router routes by them, the others ignore them). MoE reports its
aux losses and load statistics through `aux` (an AuxCollector). Each FFN defines `flops_per_token()` (active forward FLOPs) and `inactive_parameters()` when not all parameters are active.
Options: as the mixers' (model/mixers/__init__.py), read with `config.options_for_ffn(name, Options)`."""
import importlib
import pkgutil

from model.registry import FFNS

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["FFNS"]
