#!/usr/bin/env bash
# Start a real one-node SLURM cluster with accounting on this machine:
# munged, MariaDB, slurmdbd, slurmctld and slurmd, for trainflow's SLURM
# launcher (CI) and for trying SLURM locally. Installs the Debian packages
# when they are missing. Running it again keeps what already runs and only
# checks that the cluster answers. Stop everything with down.sh.
#
# Environment:
#   TRAINFLOW_SLURM_DIR      scratch dir for configs, state, logs, pid files
#                            (default /tmp/trainflow-slurm)
#   TRAINFLOW_SLURM_TIMEOUT  seconds to wait for each daemon (default 60)
#   TRAINFLOW_SLURM_DB_PORT  MariaDB port on 127.0.0.1 (default 3307)
#   TRAINFLOW_SLURM_DBD_PORT slurmdbd port (default 6819)
set -euo pipefail

T0=$SECONDS
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DIR="${TRAINFLOW_SLURM_DIR:-/tmp/trainflow-slurm}"
TIMEOUT="${TRAINFLOW_SLURM_TIMEOUT:-60}"
DB_PORT="${TRAINFLOW_SLURM_DB_PORT:-3307}"
DBD_PORT="${TRAINFLOW_SLURM_DBD_PORT:-6819}"
CLUSTER=local
# Daemons and admin tools live in sbin, which a sudo/CI PATH may lack.
export PATH="$PATH:/usr/sbin:/sbin"

say() { echo "trainflow-slurm: $*"; }
# One clear line, then the tail of the log that explains it.
fail() {
  echo "trainflow-slurm: ERROR: $1" >&2
  if [[ -n "${2:-}" && -s "$2" ]]; then
    echo "--- last lines of $2:" >&2
    tail -n 25 "$2" >&2
  fi
  exit 1
}
# running PID: the process exists and is not a zombie (it has exited).
running() {
  local st
  st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [[ -n $st && $st != Z ]]
}
# alive PIDFILE NAME...: the pid in PIDFILE runs one of the programs NAME
# (a stale pid file may point at a recycled pid).
alive() {
  local pidfile=$1 pid comm name
  shift
  [[ -s $pidfile ]] || return 1
  pid=$(<"$pidfile")
  running "$pid" || return 1
  comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
  for name; do [[ $comm == "$name" ]] && return 0; done
  return 1
}
# wait_for SECONDS COMMAND...: poll COMMAND until it succeeds.
wait_for() {
  local end=$((SECONDS + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < end)) || return 1
    sleep 0.5
  done
}

[[ $EUID -eq 0 ]] || fail "run as root (sudo bash $0): it starts system daemons"

# 0755: the mysql and munge users must reach their subdirs.
install -d -m 0755 "$DIR"
DIR="$(cd "$DIR" && pwd)"
ETC=$DIR/etc RUN=$DIR/run LOG=$DIR/log
install -d -m 0755 "$ETC" "$RUN" "$LOG" "$DIR/state/slurmctld" "$DIR/state/slurmd"

# --- packages ----------------------------------------------------------------
missing=()
for bin in munged slurmctld slurmd sbatch slurmdbd mariadbd mariadb-install-db; do
  command -v "$bin" >/dev/null || missing+=("$bin")
done
if ((${#missing[@]})); then
  say "installing SLURM, munge and MariaDB (missing: ${missing[*]})"
  # Keep apt from starting the services itself (a container without
  # systemd may run their init scripts); up.sh starts them below.
  own_policy=
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    own_policy=1
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >"$LOG/apt.log" 2>&1 ||
    fail "apt-get update failed" "$LOG/apt.log"
  apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge slurmdbd mariadb-server \
    >>"$LOG/apt.log" 2>&1 ||
    fail "apt-get install failed" "$LOG/apt.log"
  if [[ -n $own_policy ]]; then
    rm -f /usr/sbin/policy-rc.d
    trap - EXIT
  fi
fi

# --- configs -------------------------------------------------------------------
# (The users exist once the packages are installed.)
install -d -m 0755 -o mysql -g mysql "$DIR/mysql" "$RUN/mysqld"
install -d -m 0755 -o munge -g munge "$RUN/munge"
# Every SLURM command and daemon started from here uses these configs;
# slurmdbd finds slurmdbd.conf next to slurm.conf.
export SLURM_CONF=$ETC/slurm.conf

HOST=$(hostname -s)
# SLURM resolves its own hostname; containers do not always map it.
if ! getent hosts "$HOST" >/dev/null; then
  echo "127.0.0.1 $HOST" >>/etc/hosts
fi

# The node line as slurmd detects the hardware (else it complains about
# socket/core boundaries), with RealMemory at 90% to leave room for the OS.
NODE_LINE=$(slurmd -C 2>/dev/null | awk '/^NodeName=/ {
  for (i = 1; i <= NF; i++)
    if ($i ~ /^RealMemory=/) { split($i, kv, "="); $i = "RealMemory=" int(kv[2] * 0.9) }
  print; exit }')
[[ -n $NODE_LINE ]] || fail "slurmd -C did not describe this node"

# The database password is made once and kept with the configs.
if [[ ! -s $ETC/db.pass ]]; then
  (umask 077 && od -An -N12 -tx1 /dev/urandom | tr -d ' \n' >"$ETC/db.pass")
fi
DB_PASS=$(<"$ETC/db.pass")

# render TEMPLATE OUT MODE: fill in placeholders; report (status 0) when
# OUT changed.
render() {
  local tmp
  tmp=$(mktemp "$2.XXXXXX")
  sed -e "s|@HOST@|$HOST|g" -e "s|@DIR@|$DIR|g" -e "s|@NODE_LINE@|$NODE_LINE|g" \
      -e "s|@DB_PORT@|$DB_PORT|g" -e "s|@DBD_PORT@|$DBD_PORT|g" \
      -e "s|@DB_PASS@|$DB_PASS|g" "$1" >"$tmp"
  chmod "$3" "$tmp"
  if cmp -s "$tmp" "$2"; then rm -f "$tmp"; return 1; fi
  mv "$tmp" "$2"
}
slurm_conf_changed=
render "$HERE/slurm.conf.in" "$ETC/slurm.conf" 0644 && slurm_conf_changed=1
# slurmdbd refuses a config readable by others (it holds the password).
render "$HERE/slurmdbd.conf.in" "$ETC/slurmdbd.conf" 0600 || true

# Let sbatch/srun/sinfo/submitit find the cluster without SLURM_CONF, unless
# /etc/slurm/slurm.conf belongs to another setup.
etc_conf=/etc/slurm/slurm.conf
if [[ -L $etc_conf && ! -e $etc_conf ]]; then rm -f "$etc_conf"; fi # dangling
if [[ ! -e $etc_conf ]]; then
  install -d -m 0755 /etc/slurm
  ln -s "$SLURM_CONF" "$etc_conf"
elif [[ ! $etc_conf -ef $SLURM_CONF ]]; then
  say "note: $etc_conf is not ours; use this cluster with: export SLURM_CONF=$SLURM_CONF"
fi

# --- munge -------------------------------------------------------------------
# Keep a munged that already answers (ours from an earlier run, or the
# system's): there can be only one on the standard socket.
munge_ok() { munge -n | unmunge; }
if ! munge_ok >/dev/null 2>&1; then
  # The package makes the key; create one if it is missing all the same.
  if [[ ! -s /etc/munge/munge.key ]]; then
    runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
  fi
  install -d -m 0755 -o munge -g munge /run/munge
  touch "$LOG/munged.log" && chown munge:munge "$LOG/munged.log"
  runuser -u munge -- munged --pid-file="$RUN/munge/munged.pid" \
    --log-file="$LOG/munged.log" ||
    fail "munged did not start" "$LOG/munged.log"
  wait_for "$TIMEOUT" munge_ok || fail "munge does not answer" "$LOG/munged.log"
fi

# --- MariaDB -----------------------------------------------------------------
# A private server (own datadir, socket, port on 127.0.0.1), so that a system
# MariaDB, if any, is left alone. The InnoDB sizes are the least slurmdbd
# accepts without logging an error (the pool is only touched as it fills).
DB_SOCK=$RUN/mysqld/mysqld.sock
DB_PID=$RUN/mysqld/mariadbd.pid
DB_LOG=$LOG/mariadb.log
if ! alive "$DB_PID" mariadbd mysqld; then
  if [[ ! -d $DIR/mysql/mysql ]]; then
    mariadb-install-db --no-defaults --user=mysql --datadir="$DIR/mysql" \
      --auth-root-authentication-method=socket --skip-test-db \
      >"$LOG/mariadb-install.log" 2>&1 ||
      fail "mariadb-install-db failed" "$LOG/mariadb-install.log"
  fi
  # The server runs as mysql: it must be able to write its log.
  touch "$DB_LOG" && chown mysql:mysql "$DB_LOG"
  setsid mariadbd --no-defaults --user=mysql --datadir="$DIR/mysql" \
    --socket="$DB_SOCK" --pid-file="$DB_PID" --log-error="$DB_LOG" \
    --bind-address=127.0.0.1 --port="$DB_PORT" --skip-name-resolve \
    --innodb-buffer-pool-size=512M --innodb-lock-wait-timeout=900 \
    </dev/null >/dev/null 2>&1 &
  db_pid=$!
  # Give up at once if the server exits (port taken, bad datadir, ...).
  end=$((SECONDS + TIMEOUT))
  until mariadb-admin --no-defaults --socket="$DB_SOCK" -u root ping >/dev/null 2>&1; do
    if ! running "$db_pid" || ((SECONDS >= end)); then
      fail "MariaDB did not start" "$DB_LOG"
    fi
    sleep 0.5
  done
fi
wait_for "$TIMEOUT" mariadb-admin --no-defaults --socket="$DB_SOCK" -u root ping ||
  fail "MariaDB does not answer" "$DB_LOG"
# slurmdbd connects over TCP from 127.0.0.1 (names are not resolved).
db_sql() { mariadb --no-defaults --socket="$DB_SOCK" -u root; }
db_sql <<SQL || fail "could not create the accounting database" "$DB_LOG"
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
SQL

# --- slurmdbd and the accounting records -------------------------------------
if ! alive "$RUN/slurmdbd.pid" slurmdbd; then
  slurmdbd || fail "slurmdbd did not start" "$LOG/slurmdbd.log"
fi
wait_for "$TIMEOUT" sacctmgr -n list cluster ||
  fail "slurmdbd does not answer" "$LOG/slurmdbd.log"
if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
  sacctmgr -i add cluster "$CLUSTER" >/dev/null ||
    fail "sacctmgr could not add cluster $CLUSTER" "$LOG/slurmdbd.log"
fi
# Adding a cluster normally gives root an association already; make sure
# there is one, so that jobs get an account in the records.
if [[ -z $(sacctmgr -n -P list assoc cluster="$CLUSTER" user=root format=account) ]]; then
  sacctmgr -i add account trainflow cluster="$CLUSTER" \
    description=trainflow organization=trainflow >/dev/null
  sacctmgr -i add user root account=trainflow cluster="$CLUSTER" >/dev/null
fi

# --- slurmctld and slurmd ----------------------------------------------------
if ! alive "$RUN/slurmctld.pid" slurmctld; then
  slurmctld || fail "slurmctld did not start" "$LOG/slurmctld.log"
elif [[ -n $slurm_conf_changed ]]; then
  scontrol reconfigure || fail "scontrol reconfigure failed" "$LOG/slurmctld.log"
fi
wait_for "$TIMEOUT" scontrol ping || fail "slurmctld does not answer" "$LOG/slurmctld.log"
if ! alive "$RUN/slurmd.pid" slurmd; then
  slurmd || fail "slurmd did not start" "$LOG/slurmd.log"
fi

# Up means: the node takes jobs (idle, or busy with jobs from an earlier run)
# and the accounting answers.
node_up() { [[ $(sinfo -h -n "$HOST" -o %t) =~ ^(idle|mix|alloc)$ ]]; }
wait_for "$TIMEOUT" node_up ||
  fail "node $HOST does not take jobs (state: $(sinfo -h -n "$HOST" -o %t 2>&1))" "$LOG/slurmd.log"
wait_for "$TIMEOUT" sacct -n -X -o JobID -S now-1minutes ||
  fail "sacct does not answer" "$LOG/slurmdbd.log"

say "up in $((SECONDS - T0))s: cluster=$CLUSTER node=$HOST" \
  "($(sinfo -h -n "$HOST" -o '%c CPUs, %m MB, %t')) accounting=slurmdbd" \
  "dir=$DIR"
