#!/bin/bash
# Reserve PORT from this node's ephemeral range, where this process may: one line either way.
#
#   launch/slurm/reserve-port.sh PORT [FILE]
#
# The Neuron runtime's root communicator (NEURON_RT_ROOT_COMM_ID=<ip>:PORT, default 41000)
# listens on rank 0's node. 41000 lies in Linux's default ephemeral range (32768-60999,
# net.ipv4.ip_local_port_range), so any outgoing connection can take it first and the
# collectives' start-up then hangs (the Neuron troubleshooting answer to "Multiworker execution
# hangs during NCCL init" is to reserve it: aws-neuron/aws-neuron-sdk archive/nxd-training/
# training-troubleshooting.rst:318). The kernel keeps the ports listed in
# net.ipv4.ip_local_reserved_ports (FILE, default /proc/sys/net/ipv4/ip_local_reserved_ports:
# comma-separated ports and lo-hi ranges, Linux Documentation/networking/ip-sysctl.rst) out of
# that draw, as AWS's trn2 samples do (aws-neuron/aws-neuron-eks-samples, llama3.1_8B_finetune_
# ray_ptl_neuron/llama3_finetune/tp_zero1_llama3_8b_hf_finetune_ptl.sh:53).
#
# Writing FILE replaces the whole list, so PORT is appended to what is there, never written
# alone. Only root may write it: otherwise (or when FILE cannot be written, e.g. a read-only
# /proc in a container) one line says so and what an administrator would run; exit 0, since an
# unreserved port is a risk, not a certain failure (`trn-accum neuron-check` reports it).
# Exit 2 only for a bad PORT.

set -euo pipefail

port="${1:-}"
file="${2:-/proc/sys/net/ipv4/ip_local_reserved_ports}"
where="$(hostname 2>/dev/null || echo this node)"

if [[ ! "$port" =~ ^[0-9]{1,5}$ ]] || ((10#$port < 1 || 10#$port > 65535)); then
  echo "reserve-port.sh: PORT '${port}' must be a TCP port 1-65535 (usage: reserve-port.sh PORT [FILE])" >&2
  exit 2
fi
port=$((10#$port))

if [[ ! -r "$file" ]]; then
  echo "${where}: port ${port} not reserved: ${file} is not readable here (not Linux, or no" \
    "/proc/sys): reserve it on the node with sysctl -w net.ipv4.ip_local_reserved_ports=...,${port}"
  exit 0
fi
current="$(<"$file")"
current="${current//[[:space:]]/}"

# Whether $port is in the list: items are "p" or "lo-hi".
in_list() {
  local item lo hi
  local -a items
  IFS=, read -r -a items <<<"$current"
  for item in "${items[@]}"; do
    [[ -n "$item" ]] || continue
    lo="${item%-*}"
    hi="${item#*-}"
    if ((port >= lo && port <= hi)); then return 0; fi
  done
  return 1
}

if in_list; then
  echo "${where}: port ${port} already reserved (${file}: ${current})"
  exit 0
fi
wanted="${current:+${current},}${port}"
if ((EUID != 0)) || [[ ! -w "$file" ]]; then
  echo "${where}: cannot reserve port ${port} from the ephemeral range (not root, or ${file}" \
    "not writable): ask an administrator for sysctl -w net.ipv4.ip_local_reserved_ports=${wanted}"
  exit 0
fi
if ! printf '%s\n' "$wanted" 2>/dev/null >"$file"; then
  echo "${where}: cannot reserve port ${port}: writing ${file} failed (a read-only /proc?): ask" \
    "an administrator for sysctl -w net.ipv4.ip_local_reserved_ports=${wanted}"
  exit 0
fi
echo "${where}: reserved port ${port} from the ephemeral range (${file}: ${wanted})"
