#!/usr/bin/env bash
# Multi-node smoke on one machine: two torchrun launchers ("nodes" 0 and 1, 2 ranks each) meet
# at a static rendezvous on 127.0.0.1 and run one 4-rank load (dp across nodes, tp inside).
#
#   bench/multinode.sh CHECKPOINT_DIR OUT.json [KIND]
#
# On a real cluster run the same torchrun line once per node, with --node-rank set per node and
# --master-addr the first node's address (or --rdzv-backend c10d --rdzv-endpoint HOST:PORT).
set -euo pipefail
ckpt=${1:?usage: bench/multinode.sh CHECKPOINT_DIR OUT.json [KIND]}
out=${2:?usage: bench/multinode.sh CHECKPOINT_DIR OUT.json [KIND]}
kind=${3:-dense}
python=${PYTHON:-python}
port=${PORT:-$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
pids=()
for node in 0 1; do
  "$python" -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --node-rank "$node" \
    --master-addr 127.0.0.1 --master-port "$port" \
    -m bench.node_load --path "$ckpt" --kind "$kind" --out "$out" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
