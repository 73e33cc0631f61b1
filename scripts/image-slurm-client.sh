#!/bin/sh
# The Slurm client of the gpufleet image (Dockerfile: ARG SLURM_CLIENT), as root during the build:
#
#   image-slurm-client.sh RELEASE [--config-only]
#
# RELEASE is the Slurm release of the cluster's slurmctld, taken from the Debian suite that
# carries it, with munge beside it (Slurm's commands get their credentials from a munged):
#   22.05  Debian 12 bookworm
#   24.11  Debian 13 trixie (the image's own suite)
#   26.05  Debian forky (testing: no security support; no python image of that suite exists)
#   none   no Slurm client and no munge: a worker that reaches Slurm through slurmrestd
#          (GPUFLEET_SLURM_BACKEND=rest, as on Slinky) needs neither
# Anything else fails, naming the choices. A suite other than the image's own is added to apt's
# sources with a pin: only slurm-client and slurm-wlm-basic-plugins are taken from it, and
# anything else from it only where the image's suite has no such package at all (26.05 takes
# libllhttp9.4 so). The release installed is checked: a suite that has moved on to another
# release fails the build rather than make an image of the wrong one.
#
# --config-only writes apt's sources and pin (under $APT_ETC, default /etc/apt) and installs
# nothing: tests/test_image_slurm_client.py resolves the install from them against Debian's archive.
# $BASE_SUITE is the image's suite (default: its /etc/os-release).
set -eu

release=${1:-}
config_only=${2:-}
apt_etc=${APT_ETC:-/etc/apt}

case "$release" in
  22.05) suite=bookworm ;;
  24.11) suite=trixie ;;
  26.05) suite=forky ;;
  none) suite= ;;
  *)
    echo "SLURM_CLIENT=${release:-(empty)} is not a Slurm client this image can carry: use 22.05 (Debian bookworm)," \
      "24.11 (trixie), 26.05 (forky), the release of the cluster's slurmctld, or none (no Slurm client and" \
      "no munge, for a worker on slurmrestd: GPUFLEET_SLURM_BACKEND=rest)" >&2
    exit 2
    ;;
esac
case "$config_only" in
  '' | --config-only) ;;
  *)
    echo "usage: $0 RELEASE [--config-only]" >&2
    exit 2
    ;;
esac

if [ -z "$suite" ]; then
  echo "SLURM_CLIENT=none: no Slurm client, no munge"
  exit 0
fi

base=${BASE_SUITE:-$(. /etc/os-release && echo "$VERSION_CODENAME")}
if [ "$suite" != "$base" ]; then
  mkdir -p "$apt_etc/sources.list.d" "$apt_etc/preferences.d"
  cat >"$apt_etc/sources.list.d/slurm-$suite.sources" <<EOF
Types: deb
URIs: http://deb.debian.org/debian
Suites: $suite
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  cat >"$apt_etc/preferences.d/slurm-$suite" <<EOF
Explanation: nothing from $suite but what $base has no package of
Package: *
Pin: release n=$suite
Pin-Priority: 100

Explanation: Slurm $release's client from $suite
Package: slurm-client slurm-wlm-basic-plugins
Pin: release n=$suite
Pin-Priority: 990
EOF
fi
if [ "$config_only" = --config-only ]; then
  exit 0
fi

apt-get update
DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-client munge
installed=$(dpkg-query -W -f '${Version}' slurm-client)
case "$installed" in
  "$release".*) ;;
  *)
    echo "Debian $suite now carries slurm-client $installed, not Slurm $release: this script's table needs updating" >&2
    exit 1
    ;;
esac
rm -rf /var/lib/apt/lists/*
echo "slurm-client $installed and munge from Debian $suite"
