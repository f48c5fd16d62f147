"""`from model import LMConfig, DecoderLM`; importing registers both with the transformers Auto classes."""
from transformers import AutoConfig, AutoModelForCausalLM

from model.config import LMConfig
from model.lm import DecodeCache, DecoderLM
from model.registry import FFNS, MIXERS

AutoConfig.register(LMConfig.model_type, LMConfig)
AutoModelForCausalLM.register(LMConfig, DecoderLM)

__all__ = ["LMConfig", "DecoderLM", "DecodeCache", "MIXERS", "FFNS"]
