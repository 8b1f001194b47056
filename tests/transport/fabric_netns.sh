#!/bin/bash
# Runs a command in a fresh network namespace (user namespace too, so no privilege is needed where unprivileged
# user namespaces are allowed) with two interfaces on one subnet, a veth pair wsf0 = 10.9.0.1/24 and
# wsf1 = 10.9.0.2/24: libfabric's tcp provider offers one domain per interface, so a fabric transport there has two
# NICs (WSYNC_FABRIC_DOMAINS=wsf0,wsf1). A namespace that cannot be made is a failure, not a skip.
#
# Usage: fabric_netns.sh COMMAND [ARGS...]
set -eu
[ $# -ge 1 ] || { echo "usage: $0 COMMAND [ARGS...]" >&2; exit 2; }
exec unshare -rn bash -c '
  set -e
  ip link set lo up
  ip link add wsf0 type veth peer name wsf1
  ip addr add 10.9.0.1/24 dev wsf0
  ip addr add 10.9.0.2/24 dev wsf1
  ip link set wsf0 up
  ip link set wsf1 up
  export WSYNC_FABRIC_DOMAINS=wsf0,wsf1
  exec "$@"' fabric_netns "$@"
