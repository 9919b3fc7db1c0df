#!/usr/bin/env bash
# Two "hosts" on one machine: network namespaces gsb0/gsb1 joined by a veth pair (10.231.0.1/.2),
# 2 ranks each, then benchmarks/two_hosts.py under torchrun in each. Needs root (ip netns).
# Traffic stays inside the namespaces made here; they are deleted on exit.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cleanup() { ip netns del gsb0 2>/dev/null || true; ip netns del gsb1 2>/dev/null || true; }
trap cleanup EXIT
cleanup
ip netns add gsb0 && ip netns add gsb1
ip link add gsbv0 type veth peer name gsbv1
ip link set gsbv0 netns gsb0 && ip link set gsbv1 netns gsb1
for i in 0 1; do
  ip -n gsb$i addr add 10.231.0.$((i + 1))/24 dev gsbv$i
  ip -n gsb$i link set gsbv$i up && ip -n gsb$i link set lo up
done
for i in 0 1; do
  GLOO_SOCKET_IFNAME=gsbv$i ip netns exec gsb$i "${PYTHON:-python}" -m torch.distributed.run --nnodes 2 \
    --nproc-per-node 2 --node-rank $i --master-addr 10.231.0.1 --master-port 29500 "$here/two_hosts.py" &
done
wait
