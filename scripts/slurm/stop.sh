#!/usr/bin/env bash
# scripts/slurm/stop.sh - stop the single-node Slurm cluster started by scripts/slurm/start.sh.
# Cancels all jobs, then stops slurmd, slurmctld, slurmdbd, mariadbd and munged
# by PID file only (the pid's /proc/PID/comm is checked first; nothing is killed by name).
# Idempotent: safe to run when nothing is running. Pass --quiet to silence.
set -uo pipefail
QUIET=0; [[ ${1:-} == --quiet ]] && QUIET=1
log() { [[ $QUIET == 1 ]] || printf '[slurm/stop %s] %s\n' "$(date +%T)" "$*" >&2; }

# running PID -> true while the process exists and is not a zombie
running() { local st; st=$(awk '/^State:/{print $2}' "/proc/$1/status" 2>/dev/null) || return 1; [[ -n $st && $st != Z && $st != X ]]; }

# stop_pid PIDFILE COMM [TIMEOUT]
stop_pid() {
  local pidfile=$1 comm=$2 t=${3:-20} pid i
  [[ -s $pidfile ]] || { log "$comm: no pid file"; return 0; }
  pid=$(tr -dc '0-9' <"$pidfile")
  if [[ -z $pid || ! -r /proc/$pid/comm || $(cat "/proc/$pid/comm") != "$comm"* ]]; then
    log "$comm: stale pid file ($pid)"; rm -f "$pidfile"; return 0
  fi
  kill -TERM "$pid" 2>/dev/null
  for ((i = 0; i < t * 10; i++)); do running "$pid" || break; sleep 0.1; done
  if running "$pid"; then log "$comm ($pid) did not exit, SIGKILL"; kill -KILL "$pid" 2>/dev/null; sleep 0.5; fi
  log "$comm ($pid) stopped"
  rm -f "$pidfile"
}

# cancel jobs while the controller is still up so no job steps are left behind
if command -v squeue >/dev/null 2>&1 && [[ $(timeout 5 scontrol ping 2>/dev/null) == *"is UP"* ]]; then
  jobs=$(squeue -h -o '%i' 2>/dev/null)
  if [[ -n $jobs ]]; then
    log "cancelling jobs: $(echo $jobs)"
    scancel $jobs 2>/dev/null
    for _ in $(seq 1 60); do [[ -z $(squeue -h -o '%i' 2>/dev/null) ]] && break; sleep 0.5; done
  fi
fi

stop_pid /run/slurmd.pid slurmd
stop_pid /run/slurmctld.pid slurmctld
stop_pid /run/slurmdbd.pid slurmdbd
stop_pid /run/mysqld/mysqld.pid mariadbd 60
stop_pid /run/munge/munged.pid munged
exit 0
