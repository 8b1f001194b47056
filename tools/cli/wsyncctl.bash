# bash completion for wsyncctl (installed as share/bash-completion/completions/wsyncctl; or `source` this file).
# Commands and their flags as `wsyncctl --help` and `wsyncctl COMMAND --help` list them (tests/daemon/cli_test.py
# compares the two).
_wsyncctl() {
  local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}
  local commands="status nodes engines history verify checksums version plan abort resume watch remove drain undrain"
  local global="--endpoints -w --write-out -o --output --dial-timeout --log-level --log-format --tls-ca --tls-cert
    --tls-key --tls-refresh-seconds --insecure --help --version"
  case "$prev" in
    -w|--write-out|-o|--output) mapfile -t COMPREPLY < <(compgen -W "table json" -- "$cur"); return ;;
    --log-level) mapfile -t COMPREPLY < <(compgen -W "trace debug info warn error critical off" -- "$cur"); return ;;
    --log-format) mapfile -t COMPREPLY < <(compgen -W "text json" -- "$cur"); return ;;
    --tls-ca|--tls-cert|--tls-key|--model|--node-rates|--plot) mapfile -t COMPREPLY < <(compgen -f -- "$cur"); return ;;
    --endpoints|--dial-timeout|--tls-refresh-seconds|--version|--reason|--interval|--for|--idle-every|-n|--limit|\
    --rank|--step|--health-listen) return ;;
  esac
  # The command word: the first word that is neither an option nor the value of one that takes a value.
  local i cmd=""
  for ((i = 1; i < COMP_CWORD; i++)); do
    case "${COMP_WORDS[i]}" in
      --endpoints|-w|--write-out|-o|--output|--dial-timeout|--log-level|--log-format|--tls-ca|--tls-cert|--tls-key|\
      --tls-refresh-seconds) ((i++)) ;;
      -*) ;;
      *) cmd=${COMP_WORDS[i]}; break ;;
    esac
  done
  local flags=""
  case "$cmd" in
    "") mapfile -t COMPREPLY < <(compgen -W "$commands $global" -- "$cur"); return ;;
    history) flags="-n --limit --plot --version" ;;
    engines) flags="--watch --for --health-listen" ;;
    verify) flags="--engine --version --step --synthetic --all" ;;
    checksums) flags="--engine --rank" ;;
    abort) flags="--reason" ;;
    watch) flags="--interval --for --once --idle-every" ;;
    plan) flags="--model --train --infer --nic --strategy --weights --executor --tasks --seed-table --no-gather
      --min-source-mib --node-rates --models-dir" ;;
  esac
  if [ "$prev" = "--engine" ] || { [[ "$cmd" =~ ^(drain|undrain|remove)$ ]] && [[ "$cur" != -* ]]; }; then
    # Engine and node ids from the coordinator, when it answers quickly.
    local words
    words=$(wsyncctl engines -w json --dial-timeout 1 2>/dev/null | grep -o '"\(engine_id\|node_id\)": *"[^"]*"' |
            sed 's/.*: *"\(.*\)"/\1/' | sort -u)
    mapfile -t COMPREPLY < <(compgen -W "$words" -- "$cur")
    return
  fi
  mapfile -t COMPREPLY < <(compgen -W "$flags $global" -- "$cur")
}
complete -F _wsyncctl wsyncctl
