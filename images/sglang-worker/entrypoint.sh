#!/usr/bin/env bash
# Entry point of the SGLang worker image. The operator passes the full command line
# (`python3 -m sglang.launch_server --model-path ... --disaggregation-mode ...`); this script checks the
# pieces a PD pod cannot run without before handing over, so a misconfigured pod fails fast with a clear
# message instead of after a 40-minute weight load.
set -euo pipefail

fail() { echo "tandem-sglang-entrypoint: $*" >&2; exit 64; }

[ "$#" -gt 0 ] || fail "no command given (expected: python3 -m sglang.launch_server ...)"

# /dev/shm: NCCL and DeepEP need a large shared-memory mount (the operator mounts a memory-backed emptyDir).
shm_kib=$(df -k --output=size /dev/shm 2>/dev/null | tail -n 1 | tr -d ' ' || echo 0)
min_kib=${TANDEM_MIN_SHM_KIB:-1048576}
[ "${shm_kib:-0}" -ge "$min_kib" ] || fail "/dev/shm is ${shm_kib} KiB, need at least ${min_kib} KiB"

# RDMA: with --disaggregation-ib-device the named devices must exist in the pod.
args=("$@")
for i in "${!args[@]}"; do
  if [ "${args[$i]}" = "--disaggregation-ib-device" ]; then
    devs=${args[$((i + 1))]:-}
    case "$devs" in
      "{"*) ;;  # per-GPU JSON mapping: checked by SGLang itself
      *) IFS=',' read -ra names <<< "$devs"
         for dev in "${names[@]}"; do
           [ -e "/sys/class/infiniband/$dev" ] || fail "RDMA device $dev not found in /sys/class/infiniband"
         done ;;
    esac
  fi
done

exec "$@"
