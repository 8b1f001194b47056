#!/usr/bin/env bash
# wsync-certs.sh: a CA and per-role certificates for wsync's mutual TLS (docs/security.md), with the openssl CLI.
#
#   tools/cli/wsync-certs.sh DIR ROLE:ID[=SAN,...] ...
#
# DIR gets ca.pem + ca-key.pem (created once, reused when present) and, per ROLE:ID, ROLE-ID.pem and ROLE-ID-key.pem:
# an EC P-256 certificate with subject CN "ROLE:ID" (the caller's role and identity every wsync server checks), usable
# as server and client certificate, valid for --days (default 825). Its subjectAltName always holds localhost,
# 127.0.0.1 and ::1, plus the SANs given after "=" (IP addresses or DNS names, comma-separated) and those in
# WSYNC_CERT_SANS: a server's certificate must name every address its clients dial (the host in --listen/--advertise).
# Roles: coordinator, source, target, engine, admin, trainer. For a source or target daemon, ID is its --node-id.
#
# Example (the demo's cluster):
#   tools/cli/wsync-certs.sh /tmp/certs coordinator:main target:infer0 source:train0 engine:engine0 admin:ops trainer:demo
# then run each binary with --tls-ca DIR/ca.pem --tls-cert DIR/ROLE-ID.pem --tls-key DIR/ROLE-ID-key.pem.
# Test and demo use only: production CAs and keys belong in the operator's PKI (Kubernetes: cert-manager).
set -euo pipefail

days=825
if [[ "${1:-}" == "--days" ]]; then days="$2"; shift 2; fi
if [[ $# -lt 2 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
command -v openssl >/dev/null || { echo "wsync-certs.sh: openssl is not installed (Debian: apt-get install openssl)" >&2; exit 2; }
dir="$1"
shift
mkdir -p "$dir"
chmod 700 "$dir"
umask 077

if [[ ! -f "$dir/ca.pem" || ! -f "$dir/ca-key.pem" ]]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$days" \
    -subj "/O=wsync/CN=wsync test CA" -keyout "$dir/ca-key.pem" -out "$dir/ca.pem" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi

for spec in "$@"; do
  name="${spec%%=*}"
  sans=""
  [[ "$spec" == *=* ]] && sans="${spec#*=}"
  role="${name%%:*}"
  id="${name#*:}"
  case "$role" in
    coordinator|source|target|engine|admin|trainer) ;;
    *) echo "wsync-certs.sh: unknown role '$role' in '$spec' (coordinator, source, target, engine, admin, trainer)" >&2
       exit 2 ;;
  esac
  if [[ -z "$id" || "$id" == "$name" || ! "$id" =~ ^[A-Za-z0-9._-]+$ ]]; then
    echo "wsync-certs.sh: '$spec' needs ROLE:ID with ID of letters, digits, '.', '_' or '-'" >&2
    exit 2
  fi
  alt="DNS:localhost,IP:127.0.0.1,IP:::1"
  IFS=',' read -r -a extra <<< "${sans}${WSYNC_CERT_SANS:+,${WSYNC_CERT_SANS}}"
  for s in "${extra[@]}"; do
    [[ -z "$s" ]] && continue
    if [[ "$s" =~ ^[0-9.]+$ || "$s" == *:* ]]; then alt="$alt,IP:$s"; else alt="$alt,DNS:$s"; fi
  done
  base="$dir/$role-$id"
  ext="$(mktemp)"
  trap 'rm -f "$ext" "$base.csr"' EXIT
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=%s\n' \
    "$alt" > "$ext"
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/O=wsync/CN=$role:$id" \
    -keyout "$base-key.pem" -out "$base.csr" 2>/dev/null
  openssl x509 -req -in "$base.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca-key.pem" -CAcreateserial -days "$days" \
    -extfile "$ext" -out "$base.pem" 2>/dev/null
  rm -f "$ext" "$base.csr"
  trap - EXIT
  chmod 644 "$base.pem"  # certificates are public; keys stay 0600
  echo "$base.pem ($role:$id; $alt)"
done
chmod 644 "$dir/ca.pem"
