#!/usr/bin/env bash
# Stop the local SLURM cluster that up.sh started: cancel its jobs, then stop
# slurmd, slurmctld, slurmdbd, MariaDB and munged through the pid files in the
# scratch dir, and wait until they have exited. Daemons that up.sh did not
# start (no pid file of ours) are left alone. Safe to run when nothing runs.
#
# Environment: TRAINFLOW_SLURM_DIR (default /tmp/trainflow-slurm),
#              TRAINFLOW_SLURM_TIMEOUT (seconds per daemon, default 60).
set -euo pipefail

DIR="${TRAINFLOW_SLURM_DIR:-/tmp/trainflow-slurm}"
TIMEOUT="${TRAINFLOW_SLURM_TIMEOUT:-60}"
export PATH="$PATH:/usr/sbin:/sbin"

say() { echo "trainflow-slurm: $*"; }
if [[ ! -d $DIR ]]; then
  say "nothing to stop ($DIR does not exist)"
  exit 0
fi
DIR="$(cd "$DIR" && pwd)"
RUN=$DIR/run
export SLURM_CONF=$DIR/etc/slurm.conf

# pid_of PIDFILE NAME...: print the pid if it runs one of the programs NAME
# (a stale pid file may point at a recycled pid).
pid_of() {
  local pidfile=$1 pid comm name
  shift
  [[ -s $pidfile ]] || return 1
  pid=$(<"$pidfile")
  comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
  for name; do
    if [[ $comm == "$name" ]]; then echo "$pid"; return 0; fi
  done
  return 1
}

# running PID: the process exists and is not a zombie waiting for init
# to reap it (some container inits reap only every few seconds).
running() {
  local st
  st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [[ -n $st && $st != Z ]]
}

stopped=()
# stop LABEL PIDFILE NAME...: SIGTERM, wait, SIGKILL as a last resort.
stop() {
  local label=$1 pidfile=$2 pid end
  shift 2
  if pid=$(pid_of "$pidfile" "$@"); then
    kill -TERM "$pid" 2>/dev/null || true
    end=$((SECONDS + TIMEOUT))
    while running "$pid" && ((SECONDS < end)); do sleep 0.2; done
    if running "$pid"; then
      say "$label did not exit after ${TIMEOUT}s, killing it"
      kill -KILL "$pid" 2>/dev/null || true
      while running "$pid"; do sleep 0.2; done
    fi
    stopped+=("$label")
  fi
  rm -f "$pidfile"
}

# Jobs outlive slurmd (their slurmstepd keeps running): cancel them first
# and wait until slurmctld has cleaned them up.
if pid_of "$RUN/slurmctld.pid" slurmctld >/dev/null &&
   [[ -n $(squeue -h -o %i 2>/dev/null) ]]; then
  say "cancelling jobs: $(squeue -h -o %i | tr '\n' ' ')"
  squeue -h -o %i | xargs -r scancel || true
  end=$((SECONDS + TIMEOUT))
  while [[ -n $(squeue -h -o %i 2>/dev/null) ]] && ((SECONDS < end)); do
    sleep 0.5
  done
fi

stop slurmd "$RUN/slurmd.pid" slurmd
stop slurmctld "$RUN/slurmctld.pid" slurmctld
stop slurmdbd "$RUN/slurmdbd.pid" slurmdbd
stop mariadb "$RUN/mysqld/mariadbd.pid" mariadbd mysqld
stop munged "$RUN/munge/munged.pid" munged

# The /etc/slurm/slurm.conf link that up.sh made would dangle otherwise
# once the scratch dir goes.
if [[ -L /etc/slurm/slurm.conf && $(readlink /etc/slurm/slurm.conf) == "$SLURM_CONF" ]]; then
  rm -f /etc/slurm/slurm.conf
fi

if ((${#stopped[@]})); then
  say "stopped ${stopped[*]} (state and logs kept in $DIR)"
else
  say "nothing was running"
fi
