#!/bin/sh
# `demo` runs the quick-start demo with the installed binaries; `healthcheck` is the image's HEALTHCHECK; anything
# else is executed as given.
set -e
if [ "$1" = "demo" ]; then
  shift
  exec /opt/wsync/bin/demo.sh --bin /opt/wsync/bin --model /opt/wsync/share/wsync/models/Qwen__Qwen3-0.6B/config.json "$@"
fi
if [ "$1" = "healthcheck" ]; then
  # The main process's --metrics-listen HOST:PORT (either spelling), asked for /healthz over bash's /dev/tcp (the
  # slim image has no curl). A wildcard host is asked on loopback. WSYNC_HEALTH_PID: another process than PID 1
  # (deploy/validate.sh checks this against a running coordinator).
  addr=$(tr '\0' '\n' </proc/"${WSYNC_HEALTH_PID:-1}"/cmdline | sed -n '/^--metrics-listen$/{n;p;q};s/^--metrics-listen=//p' | head -n 1)
  [ -n "$addr" ] || exit 0
  host=${addr%:*}
  port=${addr##*:}
  case "$host" in "" | 0.0.0.0 | "[::]") host=127.0.0.1 ;; esac
  host=$(echo "$host" | tr -d '[]')
  exec bash -c 'exec 3<>"/dev/tcp/$0/$1" && printf "GET /healthz HTTP/1.0\r\nHost: %s\r\n\r\n" "$0" >&3 &&
                head -n 1 <&3 | grep -q " 200 "' "$host" "$port"
fi
exec "$@"
