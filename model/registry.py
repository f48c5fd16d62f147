"""Name -> class registries for sequence mixers and FFNs. A new block is one file that
decorates its class with `@MIXERS.register("name")` (or FFNS) plus one config file."""
from common.registry import Registry


MIXERS = Registry("mixer")
FFNS = Registry("ffn")
