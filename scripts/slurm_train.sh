#!/usr/bin/env bash
# One training run over SLURM nodes: one `accelerate launch` per node, each starting one process per
# GPU, all joined into one job (DDP; add --use_fsdp ... or a --config_file for FSDP).
#   sbatch --nodes 2 --gpus-per-node 8 scripts/slurm_train.sh model=350m run_dir=/shared/runs/350m
# Arguments are train.py's. run_dir must be on a filesystem every node sees (checkpoint shards from
# every rank and the export are written there); resubmitting with the same run_dir and resume=auto
# continues the run, on any node count (docs/distributed.md).
#SBATCH --job-name=swaplm
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
export HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export NUM_PROCESSES=$((SLURM_NNODES * ${SLURM_GPUS_ON_NODE:-8}))
# $SLURM_NODEID is read on each node (single quotes), so each node gets its own machine rank.
srun --kill-on-bad-exit=1 bash -c 'exec accelerate launch --multi_gpu --num_machines "$SLURM_NNODES" \
    --num_processes "$NUM_PROCESSES" --machine_rank "$SLURM_NODEID" --main_process_ip "$HEAD_NODE" \
    --main_process_port 29500 --rdzv_backend static --same_network --mixed_precision bf16 train.py "$@"' _ "$@"
