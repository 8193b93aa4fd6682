#!/usr/bin/env bash
# Multi-node pretraining under SLURM (one task per GPU; Lightning reads the SLURM environment):
#   sbatch scripts/slurm_pretrain.sh configs/pretrain/roberta-base.yaml
#   sbatch --nodes 4 scripts/slurm_pretrain.sh configs/pretrain/roberta-base.yaml \
#       --config configs/pretrain/roberta-base-nope.yaml --data.batch_size 16      # no PE: the override after the base
# The global batch (256) is kept by deriving gradient accumulation from nodes × GPUs.
# Requeue-friendly: 300 s before the time limit (--signal) and on pre-emption SLURM sends SIGTERM to every task;
# train.py then saves <default_root_dir>/checkpoints/last.ckpt at the next optimizer step (all ranks agree on which)
# and exits with status 143. This script requeues the job on 143 (pre-emption requeues it by itself, --requeue), and
# the requeued job resumes exactly from last.ckpt (--ckpt_path last), appending to the same log (--open-mode).
# A job that ends with any other status is not requeued: 0 is a finished run (exported), 2 a bad input.
#SBATCH --job-name=posart-pretrain
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -uo pipefail
CONFIG=${1:?usage: sbatch scripts/slurm_pretrain.sh CONFIG [train.py arguments...]}
shift
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}" || exit 1
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-8}
export TOKENIZERS_PARALLELISM=false
GPUS_PER_NODE=${SLURM_NTASKS_PER_NODE:-4}
PREEMPTED=143  # train.py: SIGTERM handled, last.ckpt saved

echo "job ${SLURM_JOB_ID:-?} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_NNODES:-1} node(s): $CONFIG $*"
srun --kill-on-bad-exit=1 python train.py fit --config "$CONFIG" \
  --trainer.num_nodes "${SLURM_NNODES:-1}" --trainer.devices "$GPUS_PER_NODE" --ckpt_path last "$@" &
RUN=$!
# On pre-emption the batch shell gets SIGTERM too: keep waiting while the tasks save their checkpoint.
trap 'echo "batch script: SIGTERM, waiting for train.py to save last.ckpt" >&2' TERM
STATUS=0
wait "$RUN" || STATUS=$?
while kill -0 "$RUN" 2>/dev/null; do  # the wait above was cut short by the trapped signal
  STATUS=0
  wait "$RUN" || STATUS=$?
done
if [ "$STATUS" -eq "$PREEMPTED" ] && [ -n "${SLURM_JOB_ID:-}" ]; then
  echo "train.py stopped by SIGTERM with last.ckpt saved: requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID" || echo "scontrol requeue failed: resubmit the same command to resume" >&2
fi
exit "$STATUS"
