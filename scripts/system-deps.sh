#!/usr/bin/env bash
# Installs Debian's slurm-wlm and munge, openssh-server and -client (login nodes), debootstrap (the lab's newer Slurm roots), slurmdbd and mariadb-server (for clusters with accounting),
# slurmrestd and its JWT plugin (Slurm's REST API), prometheus (the lab's shared pool), kubectl (Debian's kubernetes-client) and docker-compose when missing (as root), else says what to install.
# A kubectl already on PATH (e.g. 1.32) is used as it is.
set -euo pipefail
if ! command -v kubectl >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing kubectl (Debian's kubernetes-client)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends kubernetes-client >/dev/null
  else
    echo "kubectl is missing: the kubectl tests are skipped (install kubectl, or apt-get install kubernetes-client)" >&2
  fi
fi
if ! command -v debootstrap >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing debootstrap (the lab's Slurm 24.11 and 26.05 roots)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
  else
    echo "debootstrap is missing: Slurm 24.11 and 26.05 are not offered in the lab (apt-get install debootstrap, as root)" >&2
  fi
fi
if ! command -v docker-compose >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing docker-compose (Debian's, to validate docker-compose.temporal.yml)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
  else
    echo "docker-compose is missing: the compose file's validation is skipped (apt-get install docker-compose)" >&2
  fi
fi
extras=(slurmdbd mariadb-server slurmrestd slurm-wlm-jwt-plugin prometheus)
if ! command -v slurmdbd >/dev/null 2>&1 || ! command -v mariadbd >/dev/null 2>&1 \
  || ! command -v slurmrestd >/dev/null 2>&1 || ! dpkg -s slurm-wlm-jwt-plugin >/dev/null 2>&1 \
  || ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${extras[*]} (accounting, Slurm's REST API, the lab's Prometheus)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${extras[@]}" >/dev/null
  else
    echo "some of ${extras[*]} are missing: the tests that need them are skipped (apt-get install them)" >&2
  fi
fi
if [ ! -x /usr/sbin/sshd ] || ! command -v ssh >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing openssh-server and openssh-client (the lab clusters' login nodes)"
    apt-get update -qq
    # The package's own sshd is not wanted here: each cluster's login node starts its own.
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
      chmod 755 /usr/sbin/policy-rc.d
      trap 'rm -f /usr/sbin/policy-rc.d' EXIT  # gone again however apt-get ends
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openssh-server openssh-client >/dev/null
  else
    echo "sshd or ssh is missing: the lab's clusters get no login node and its tests are skipped (apt-get install openssh-server openssh-client, as root)" >&2
  fi
fi
missing=()
for tool in slurmctld slurmd munged scontrol sbatch; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing slurm-wlm and munge (missing: ${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
  exit 0
fi
echo "missing: ${missing[*]}" >&2
echo "install Slurm and MUNGE first, e.g. as root: apt-get install slurm-wlm munge" >&2
exit 1
