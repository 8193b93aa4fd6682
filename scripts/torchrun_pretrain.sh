#!/usr/bin/env bash
# Pretraining on one machine with several GPUs, launched by torchrun (resumes from last.ckpt when there is one).
#   scripts/torchrun_pretrain.sh configs/pretrain/roberta-base.yaml 4
#   scripts/torchrun_pretrain.sh configs/pretrain/roberta-base.yaml 8 --config configs/pretrain/roberta-base-nope.yaml
# Several machines without SLURM: run on each node with NNODES, NODE_RANK, MASTER_ADDR (and MASTER_PORT) set:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 scripts/torchrun_pretrain.sh configs/pretrain/roberta-base.yaml 4
# SIGTERM to torchrun reaches every worker: train.py saves last.ckpt at the next optimizer step and exits with 143
# (torchrun then reports the workers as failed); run the same command again to resume exactly.
set -euo pipefail
CONFIG=${1:?usage: scripts/torchrun_pretrain.sh CONFIG [GPUS_PER_NODE] [train.py arguments...]}
GPUS=${2:-$(nvidia-smi -L 2>/dev/null | wc -l)}
shift $(( $# >= 2 ? 2 : 1 ))
NNODES=${NNODES:-1}
cd "$(dirname "$0")/.."
if [ "$NNODES" -eq 1 ]; then
  RENDEZVOUS=(--standalone)
else
  RENDEZVOUS=(--nnodes "$NNODES" --node_rank "${NODE_RANK:?set NODE_RANK}" --master_addr "${MASTER_ADDR:?set MASTER_ADDR}"
              --master_port "${MASTER_PORT:-29500}")
fi
exec torchrun "${RENDEZVOUS[@]}" --nproc_per_node "$GPUS" train.py fit --config "$CONFIG" \
  --trainer.devices "$GPUS" --trainer.num_nodes "$NNODES" --ckpt_path last "$@"
