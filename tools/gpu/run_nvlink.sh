#!/bin/bash
# On a GPU machine with two GPUs joined by NVLink (nvidia-h200-x2), from the repository root,
# with a bundle made by tools/gpu/bundle.sh in BUNDLE (default .gpu): the CUDA IPC path GPU 0 ->
# GPU 1 measured against its baselines in one run, and the KV-cache pipeline across the two
# GPUs. Output goes to stdout and, when OUT is set, to files under it.
#   fabric-bench-gpu --op nvlink --peer-gpu 1   single and paged writes against
#                                               cudaMemcpyPeerAsync; ping-pong latency
#   bench/nccl_p2p.py                           NCCL send/recv through torch.distributed
#   fabric-kv-gpu                               decode in this process on GPU 0 (staged), in a
#                                               process on GPU 1 with FABRIC_CUDA_IPC=off
#                                               (staged) and with the path (NVLink)
BUNDLE=${BUNDLE:-.gpu}
ROOT=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=$ROOT/$BUNDLE/lib:$LD_LIBRARY_PATH PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/nvlink-out}
mkdir -p "$OUT"
nvidia-smi -L
nvidia-smi topo -m 2>/dev/null | head -4
if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then
  echo "run_nvlink.sh: needs two GPUs"
  exit 2
fi
cd "$BUNDLE" || exit 1
# PROVIDERS: the engines' message transports; KERNEL_BYTES: values of
# FABRIC_CUDA_IPC_KERNEL_BYTES to run shm with besides the default (docs/cuda-ipc.md).
for provider in ${PROVIDERS:-shm tcp}; do
  echo "== fabric-bench-gpu --op nvlink --peer-gpu 1 --provider $provider --iters 11 =="
  timeout -k 10 240 ./fabric-bench-gpu --op nvlink --peer-gpu 1 --provider $provider --iters 11 2>&1 |
    tee "$OUT/nvlink_$provider.txt"
done
for k in ${KERNEL_BYTES:-}; do
  echo "== FABRIC_CUDA_IPC_KERNEL_BYTES=$k fabric-bench-gpu --op nvlink --peer-gpu 1 --iters 11 =="
  FABRIC_CUDA_IPC_KERNEL_BYTES=$k timeout -k 10 240 ./fabric-bench-gpu --op nvlink --peer-gpu 1 \
    --provider shm --iters 11 2>&1 | tee "$OUT/nvlink_shm_kernel_$k.txt"
done
echo "== bench/nccl_p2p.py =="
timeout -k 10 240 python3 "$ROOT/bench/nccl_p2p.py" --iters 11 2>&1 | tee "$OUT/nccl_p2p.txt"
if [ -x ./fabric-kv-gpu ]; then
  echo "== fabric-kv-gpu --provider shm --requests 8 (decode in this process, GPU 0) =="
  timeout -k 10 240 ./fabric-kv-gpu --provider shm --requests 8 2>&1 | tee "$OUT/kv_1proc.txt" | tail -14
  echo "== FABRIC_CUDA_IPC=off fabric-kv-gpu --provider shm --requests 8 --decode-gpu 1 =="
  FABRIC_CUDA_IPC=off timeout -k 10 240 ./fabric-kv-gpu --provider shm --requests 8 --decode-gpu 1 2>&1 |
    tee "$OUT/kv_2gpu_staged.txt" | tail -14
  echo "== fabric-kv-gpu --provider shm --requests 8 --decode-gpu 1 =="
  timeout -k 10 240 ./fabric-kv-gpu --provider shm --requests 8 --decode-gpu 1 2>&1 |
    tee "$OUT/kv_2gpu_ipc.txt" | tail -14
fi
