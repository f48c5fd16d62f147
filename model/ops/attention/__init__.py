"""Causal softmax attention's ops. The attention itself is torch's (SDPA on CPU, FlexAttention's block mask on
CUDA: model/mixers/softmax.py); context_parallel.py holds its context-parallel form, a slice's queries over the
keys gathered up to its end."""
