#!/bin/bash
# Runs a command in a network namespace of its own (a user namespace too, so no privilege is needed where unprivileged
# user namespaces are allowed) with only its loopback link, up, and WSYNC_TEST_PRIVATE_NETNS=1: a test case run this
# way may take that link down (the conformance suite's [.dead_link] case). A namespace that cannot be made is a
# failure, not a skip.
#
# Usage: private_netns.sh COMMAND [ARGS...]
set -eu
[ $# -ge 1 ] || { echo "usage: $0 COMMAND [ARGS...]" >&2; exit 2; }
exec unshare -rn bash -c '
  set -e
  ip link set lo up
  export WSYNC_TEST_PRIVATE_NETNS=1
  exec "$@"' private_netns "$@"
