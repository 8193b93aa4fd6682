#!/usr/bin/env bash
# Multi-node pretraining under SLURM (one task per GPU; Lightning reads the SLURM environment):
#   sbatch scripts/slurm_pretrain.sh configs/pretrain/roberta-base.yaml
#   sbatch --nodes 4 scripts/slurm_pretrain.sh configs/pretrain/roberta-base-nope.yaml --data.batch_size 16
# The global batch (256) is kept by deriving gradient accumulation from nodes × GPUs. The job requeues itself before
# its time limit (SIGUSR1, Lightning's auto-requeue) and resumes exactly from <default_root_dir>/checkpoints/last.ckpt
# (saved every --checkpoint.every_n_train_steps; the hpc_ckpt_*.ckpt Lightning writes on the signal is not used).
#SBATCH --job-name=posart-pretrain
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --signal=SIGUSR1@300
#SBATCH --requeue
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
CONFIG=${1:?usage: sbatch scripts/slurm_pretrain.sh CONFIG [train.py arguments...]}
shift
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-8}
export TOKENIZERS_PARALLELISM=false
GPUS_PER_NODE=${SLURM_NTASKS_PER_NODE:-4}
srun --kill-on-bad-exit=1 python train.py fit --config "$CONFIG" \
  --trainer.num_nodes "${SLURM_NNODES:-1}" --trainer.devices "$GPUS_PER_NODE" --ckpt_path last "$@"
