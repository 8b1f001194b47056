#!/bin/sh
# `demo` runs the quick-start demo with the installed binaries; anything else is executed as given.
set -e
if [ "$1" = "demo" ]; then
  shift
  exec /opt/wsync/bin/demo.sh --bin /opt/wsync/bin --model /opt/wsync/share/wsync/models/Qwen__Qwen3-0.6B/config.json "$@"
fi
exec "$@"
