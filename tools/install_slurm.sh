#!/usr/bin/env bash
# Installs Debian's Slurm (controller, node daemon, client) and MUNGE for the cluster tests
# (`make cluster-test`). Needs root and the distribution's package mirror; does nothing when the
# daemons are already installed. The daemons are not started here: the test starts its own
# one-node cluster on loopback in a temporary directory.
set -euo pipefail
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
  && command -v munged >/dev/null; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "error: installing slurm-wlm and munge needs root (apt-get); run as root or install them" >&2
  exit 2
fi
export DEBIAN_FRONTEND=noninteractive
# Keep the packages' maintainer scripts from starting system-wide daemons.
POLICY=/usr/sbin/policy-rc.d
CREATED_POLICY=0
if [ ! -e "$POLICY" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$POLICY" && chmod +x "$POLICY" && CREATED_POLICY=1
fi
trap '[ "$CREATED_POLICY" = 1 ] && rm -f "$POLICY"' EXIT
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
