"""GPU self-check in two stages, each within its own time budget on one H100/H200, fla's autotuning
included (docs/gpu.md: how to run them, what each check proves).

    python scripts/gpu_check.py --stage kernels   # budget 4 min: the fast paths training uses, against our CPU path
    python scripts/gpu_check.py --stage train     # budget 5 min: model=125m per mixer at T=2048 through train.py

A stage prints its budget, then runs its checks one by one. Every case of a check is guarded (an
exception is that case's failure) and every check runs under its own deadline (SIGALRM; the deadlines
add up to the budget, so the stage ends within it by construction): one failure or overrun cannot hide
the other checks or the summary. The stage ends with a summary table, writes every result to a JSON
file (its path is printed) and exits 1 on any mismatch. Without CUDA a stage runs its CPU part and
lists the checks that need CUDA.

Stage kernels (CUDA unless marked CPU):
  cpu      (CPU) our PyTorch paths agree with each other in float64; the MFU peak tables
  peak     bf16 and fp32 matmul TFLOP/s measured beside the datasheet row MFU divides by
  fla      every fla kernel through our dispatch (asserting it ran), fp32 and bf16 (q, k, v in bf16, gates
           and states in fp32, as the mixers hand them under autocast), packed (cu_seqlens: the training
           path) and with initial states: GDN chunk (gdn's and derived_gdn's head shapes), GDN recurrent (one
           decoding step), linear attention, Mamba2's SSD via chunk_simple_gla (its B, C groups repeated to
           the heads); outputs, final states and gradients against our CPU path in float64. The head counts
           and widths are model=125m's, so the configs fla autotunes (cached on disk by Triton) are the ones
           stage train needs
  moe      MoE under bf16 autocast takes torch._grouped_mm; it matches the CPU expert loop, forward and backward
  dsa      the DSA ops on CUDA (top-k with documents, cuSPARSE SDDMM/SpMM, masked SDPA, indexer scores)
           against the CPU csr path; 1, 2 and 4 KV heads
  flex     FlexAttention with a document BlockMask against SDPA with the same boolean mask, fp32 and bf16,
           forward and backward, 12 query heads on 4 KV heads
  model    per mixer, 2 layers at model=125m's widths with document positions: CUDA fp32 loss and logits
           against the CPU; AdamW steps, then bf16 autocast logits against fp32 (norm-wise: DSA's top-k may
           flip on near-ties for a few tokens); greedy generate with the cache against the full forward
  compile  torch.compile logits against eager with document positions (softmax: FlexAttention; gdn: fla)
Stage train:
  plan     (CPU) each mixer's train.py config composes and validates; its 125m model's size and FLOPs/token
  data     the token cache the runs read, built once
  train    train.py model=125m at T=2048, batch 8, per mixer for an equal share of the time left (SIGTERM
           stops it): tokens/s and MFU (median over the log windows after the first), peak memory, the
           train loss falling from the first window to the last
"""
import argparse
import sys
from pathlib import Path

from checks.run import STAGES, run_stage
from checks.stage import MIXERS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", required=True, choices=tuple(STAGES))
    parser.add_argument("--mixers", nargs="+", default=MIXERS, choices=MIXERS, metavar="MIXER",
                        help=f"stage train: the mixers to train (default: all of {', '.join(MIXERS)})")
    parser.add_argument("--json", type=Path, default=None, help="results file (default: outputs/gpu_check/<stage>.json)")
    args = parser.parse_args(argv)
    return run_stage(args.stage, args.mixers, args.json)


if __name__ == "__main__":
    sys.exit(main())
