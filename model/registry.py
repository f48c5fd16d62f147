"""Name -> class registries for sequence mixers, FFNs and MoE routers. A new mixer or FFN is one file that
decorates its class with `@MIXERS.register("name")` (or FFNS) plus one config file; a new router is one file
in model/ffn/routers/ decorated `@ROUTERS.register("name")`."""
from common.registry import Registry


MIXERS = Registry("mixer")
FFNS = Registry("ffn")
ROUTERS = Registry("router")
