#!/usr/bin/env bash
# Entry point of the SGLang worker image. The operator passes the full command line as the container's args
# (`python3 -m sglang.launch_server --model-path ... --disaggregation-mode ...`); this script checks the
# pieces a PD pod cannot run without before handing over, so a misconfigured pod fails fast with a clear
# message instead of after a 40-minute weight load. It also fills in what the recipe leaves to the node:
#
# - NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, when unset (no spec.transfer.socketInterface): the interface that
#   holds the pod's IP ($POD_IP, status.podIP; with hostNetwork the node's IP), so bare-metal hosts with bond0,
#   enp*, ens* need no name in the recipe. When set, every plain name they list must exist here.
# - RDMA devices, when the operator asks for RDMA ($TANDEM_TRANSFER_PROTOCOL=rdma) without naming any
#   (spec.transfer.ibDevices empty): every device in /sys/class/infiniband with an ACTIVE port, appended as
#   --disaggregation-ib-device and exported as NCCL_IB_HCA, NVSHMEM_HCA_LIST and MOONCAKE_DEVICE where unset.
#
# It prints what it found on one line (stderr) and fails with exit status 64 and one line naming the setting.
# TANDEM_SYSFS_ROOT (tests only) replaces /sys for the RDMA devices; network interfaces are asked of the kernel.
set -euo pipefail

fail() { echo "tandem-sglang-entrypoint: $*" >&2; exit 64; }

[ "$#" -gt 0 ] || fail "no command given (expected: python3 -m sglang.launch_server ...)"

sysfs=${TANDEM_SYSFS_ROOT:-/sys}
found=()

# /dev/shm: NCCL and DeepEP need a large shared-memory mount (the operator mounts a memory-backed emptyDir).
shm_kib=$(df -k --output=size /dev/shm 2>/dev/null | tail -n 1 | tr -d ' ' || echo 0)
min_kib=${TANDEM_MIN_SHM_KIB:-1048576}
[ "${shm_kib:-0}" -ge "$min_kib" ] || fail "/dev/shm is ${shm_kib} KiB, need at least ${min_kib} KiB"

# netifs [IP]: the network interfaces of this network namespace, or those holding the address IP (IPv4 or IPv6),
# one a line. Asked of the kernel (if_nameindex(3), getifaddrs(3)) with Python's standard library only: the image
# need not have iproute2, and /sys/class/net shows the namespace of whoever mounted sysfs. An IPv4 alias label
# (bond0:1) is reported as its interface (bond0).
netifs() {
  command -v python3 >/dev/null || fail "python3 not found (needed to list the network interfaces)"
  python3 - "$@" <<'PY'
import ctypes
import socket
import sys

if len(sys.argv) < 2:
    print("\n".join(name for _index, name in socket.if_nameindex()))
    sys.exit(0)
family = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
try:
    want = socket.inet_pton(family, sys.argv[1])
except OSError:
    sys.exit(f"tandem-sglang-entrypoint: POD_IP {sys.argv[1]} is not an IP address")


class IfAddrs(ctypes.Structure):  # struct ifaddrs, <ifaddrs.h>
    pass


IfAddrs._fields_ = [
    ("next", ctypes.POINTER(IfAddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.c_void_p),
    ("netmask", ctypes.c_void_p),
    ("ifu", ctypes.c_void_p),
    ("data", ctypes.c_void_p),
]
libc = ctypes.CDLL(None, use_errno=True)
head = ctypes.POINTER(IfAddrs)()
if libc.getifaddrs(ctypes.byref(head)) != 0:
    sys.exit(f"tandem-sglang-entrypoint: getifaddrs: errno {ctypes.get_errno()}")
# sockaddr_in: family(2) port(2) addr(4); sockaddr_in6: family(2) port(2) flowinfo(4) addr(16)
offset, size = (4, 4) if family == socket.AF_INET else (8, 16)
holders, node = [], head
while node:
    ifa = node.contents
    if ifa.addr and ctypes.c_ushort.from_address(ifa.addr).value == family:
        if ctypes.string_at(ifa.addr + offset, size) == want:
            name = ifa.name.decode().split(":")[0]
            if name not in holders:
                holders.append(name)
    node = ifa.next
libc.freeifaddrs(head)
print("\n".join(holders))
PY
}

# check_ifnames VAR SYNTAX: every interface $VAR names must exist here. SYNTAX nccl: NCCL's (a comma list of name
# prefixes; `=` before the list: exact names; `^` before it: interfaces to leave out, not checked); gloo: PyTorch's
# GLOO_SOCKET_IFNAME (a comma list of exact names).
check_ifnames() {
  local var=$1 syntax=$2 value=${!1} list exact=1 name have
  list=$value
  if [ "$syntax" = nccl ]; then
    case "$list" in
      "^"*) return 0 ;;
      "="*) list=${list#=} ;;
      *) exact=0 ;;
    esac
  fi
  [ -n "${interfaces+set}" ] || interfaces=$(netifs) || fail "cannot list the network interfaces"
  IFS=',' read -ra names <<< "$list"
  for name in "${names[@]}"; do
    [ -n "$name" ] || continue
    while IFS= read -r have; do
      if [ "$have" = "$name" ] || { [ "$exact" = 0 ] && [[ "$have" == "$name"* ]]; }; then continue 2; fi
    done <<< "$interfaces"
    fail "network interface $name ($var=$value, set from spec.transfer.socketInterface) not found on this host;" \
      "it has: $(paste -sd, <<< "$interfaces")"
  done
}

# Sockets of NCCL's bootstrap and Gloo's CPU collectives: a name the user gave must exist, a missing one is the
# interface that holds the pod's IP (NCCL gets `=name`: an exact match, not every interface the name prefixes).
[ -z "${NCCL_SOCKET_IFNAME:-}" ] || check_ifnames NCCL_SOCKET_IFNAME nccl
[ -z "${GLOO_SOCKET_IFNAME:-}" ] || check_ifnames GLOO_SOCKET_IFNAME gloo
if [ -z "${NCCL_SOCKET_IFNAME:-}" ] || [ -z "${GLOO_SOCKET_IFNAME:-}" ]; then
  if [ -n "${POD_IP:-}" ]; then
    holders=$(netifs "$POD_IP") || exit 64
    iface=$(head -n 1 <<< "$holders")
    [ -n "$iface" ] || fail "no network interface holds POD_IP $POD_IP; name one in spec.transfer.socketInterface"
    [ -n "${NCCL_SOCKET_IFNAME:-}" ] || export NCCL_SOCKET_IFNAME="=$iface"
    [ -n "${GLOO_SOCKET_IFNAME:-}" ] || export GLOO_SOCKET_IFNAME="$iface"
    found+=("POD_IP $POD_IP on $iface")
  else
    found+=("POD_IP unset: NCCL and Gloo choose their interface")
  fi
fi
[ -z "${NCCL_SOCKET_IFNAME:-}" ] || found+=("NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME")
[ -z "${GLOO_SOCKET_IFNAME:-}" ] || found+=("GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME")

# RDMA: with --disaggregation-ib-device the named devices must exist in the pod; with RDMA asked for and no device
# named, every device with an ACTIVE port is used.
args=("$@")
ib_at=-1
for i in "${!args[@]}"; do
  [ "${args[$i]}" = "--disaggregation-ib-device" ] && ib_at=$((i + 1))
done
devs=""
[ "$ib_at" -lt 0 ] || devs=${args[$ib_at]:-}
case "$devs" in
  "") ;;
  "{"*) ;;  # per-GPU JSON mapping: checked by SGLang itself
  *) IFS=',' read -ra names <<< "$devs"
     for dev in "${names[@]}"; do
       [ -e "$sysfs/class/infiniband/$dev" ] || fail "RDMA device $dev not found in /sys/class/infiniband" \
         "(spec.transfer.ibDevices)"
     done ;;
esac
if [ -z "$devs" ] && [ "${TANDEM_TRANSFER_PROTOCOL:-}" = rdma ]; then
  active=()
  for dev in "$sysfs"/class/infiniband/*; do
    for state in "$dev"/ports/*/state; do
      if [ -r "$state" ] && grep -q ACTIVE "$state"; then active+=("${dev##*/}"); break; fi
    done
  done
  [ "${#active[@]}" -gt 0 ] || fail "no RDMA device with an ACTIVE port in /sys/class/infiniband; name them in" \
    "spec.transfer.ibDevices, give the pod the host's RDMA devices (spec.transfer.rdmaResource), or use" \
    "spec.transfer.protocol tcp"
  devs=$(IFS=,; echo "${active[*]}")
  if [ "$ib_at" -lt 0 ]; then args+=("--disaggregation-ib-device" "$devs"); else args[ib_at]=$devs; fi
  [ -n "${NCCL_IB_HCA:-}" ] || export NCCL_IB_HCA="=$devs"
  [ -n "${NVSHMEM_HCA_LIST:-}" ] || export NVSHMEM_HCA_LIST="$devs"
  # The Mooncake Store reuses the rank's PD transfer engine only for the same device string.
  if [ "${MOONCAKE_PROTOCOL:-}" = rdma ] && [ -z "${MOONCAKE_DEVICE:-}" ]; then export MOONCAKE_DEVICE="$devs"; fi
  found+=("RDMA devices ACTIVE: $devs (--disaggregation-ib-device, NCCL_IB_HCA=$NCCL_IB_HCA," \
    "NVSHMEM_HCA_LIST=$NVSHMEM_HCA_LIST)")
elif [ -n "$devs" ]; then
  found+=("RDMA devices: $devs")
fi

summary=$(printf '%s; ' "${found[@]}")
echo "tandem-sglang-entrypoint: preflight: ${summary%; }" >&2
exec "${args[@]}"
