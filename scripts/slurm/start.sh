#!/usr/bin/env bash
# scripts/slurm/start.sh - install (Debian packages) and start a single-node Slurm cluster
# WITHOUT systemd, for CI and for trying `python train.py -m launcher=slurm ...` on one machine. Idempotent: if the cluster is already up and healthy it
# does nothing; otherwise it cleans up leftovers and (re)starts everything.
#
# Tested on Debian 12 (bookworm), Slurm 22.05.8, MUNGE 0.5.15, MariaDB 10.11, as root,
# inside a firecracker VM whose PID 1 is not systemd (hostname "vm").
#
# Result: partition "debug" (default) with node "localhost" (NodeAddr 127.0.0.1),
#         config in /etc/slurm, logs in /var/log/slurm, daemons detached (survive the
#         calling shell), sacct working (unless SLURM_ACCOUNTING=0).
#
# Environment knobs:
#   SLURM_ACCOUNTING=1  also install/start MariaDB + slurmdbd so `sacct` works.
#                       submitit polls sacct; WITHOUT it a job that dies without writing
#                       its result pickle (OOM-kill, SIGKILL, node failure) makes
#                       hydra-submitit-launcher wait forever.            (default 1)
#   SLURM_FRESH=1       on (re)start wipe slurmctld job state and the accounting DB so
#                       job ids restart at 1 with no stale records.    (default 1)
#   SLURM_CPUS=N        advertise N CPUs instead of the real count (uses
#                       SlurmdParameters=config_overrides; allows oversubscription).
#   SLURM_SMOKE=1       run `srun true` at the end as a smoke test.    (default 1)
#   SLURM_CGROUP=1      use proctrack/cgroup + task/cgroup (memory limits enforced,
#                       --mem OOM-kills; CR_Core_Memory, DefMemPerCPU=1000). Works on
#                       this VM's cgroup v1 hybrid mounts; default 0 = no cgroups at all.
#   SLURM_CLUSTER_NAME  (default "ci")
#
# Stop with scripts/slurm/stop.sh (kills by PID file only). Adapted from the project's reference notes
# (shared/slurm/slurm_findings.md): why each step is needed is explained there.
set -euo pipefail

SLURM_ACCOUNTING=${SLURM_ACCOUNTING:-1}
SLURM_FRESH=${SLURM_FRESH:-1}
SLURM_SMOKE=${SLURM_SMOKE:-1}
SLURM_CGROUP=${SLURM_CGROUP:-0}
CLUSTER=${SLURM_CLUSTER_NAME:-ci}
NODE=localhost
PARTITION=debug
CONF_DIR=/etc/slurm
LOG_DIR=/var/log/slurm
STATE_DIR=/var/spool/slurmctld
SPOOL_DIR=/var/spool/slurmd
DB_NAME=slurm_acct_db
DB_USER=slurm
DB_PASS=slurmci-local-only
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

T_START=$(date +%s.%N)
APTLOG=$(mktemp)
log() { printf '[slurm/start %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "ERROR: $*"; for f in slurmctld slurmd slurmdbd; do [[ -f $LOG_DIR/$f.log ]] && { log "--- tail $LOG_DIR/$f.log"; tail -n 15 "$LOG_DIR/$f.log" >&2; }; done; exit 1; }
elapsed() { awk -v a="$T_START" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'; }

# pid_alive PIDFILE COMM -> 0 if the pid in PIDFILE is running and its comm matches
pid_alive() {
  local pidfile=$1 comm=$2 pid
  [[ -s $pidfile ]] || return 1
  pid=$(tr -dc '0-9' <"$pidfile")
  [[ -n $pid && -r /proc/$pid/comm ]] || return 1
  [[ $(cat "/proc/$pid/comm") == "$comm"* ]] || return 1
  ! grep -qE '^State:\s+[ZX]' "/proc/$pid/status" 2>/dev/null   # zombies count as dead
}

# wait_for SECONDS CMD... -> poll CMD every 0.25 s
wait_for() {
  local t=$1; shift
  local end=$(( $(date +%s) + t ))
  until "$@" >/dev/null 2>&1; do
    (( $(date +%s) < end )) || return 1
    sleep 0.25
  done
}

node_ready() {
  local st
  st=$(sinfo -h -n "$NODE" -o '%T' 2>/dev/null) || return 1
  [[ $st == idle* || $st == mixed* || $st == allocated* || $st == completing* ]]
}

healthy() {
  [[ -f $CONF_DIR/slurm.conf ]] || return 1
  pid_alive /run/munge/munged.pid munged || return 1
  pid_alive /run/slurmctld.pid slurmctld || return 1
  pid_alive /run/slurmd.pid slurmd || return 1
  [[ $(timeout 10 scontrol ping 2>/dev/null) == *"is UP"* ]] || return 1
  node_ready || return 1
  if [[ $SLURM_CGROUP == 1 ]]; then grep -q '^ProctrackType=proctrack/cgroup' "$CONF_DIR/slurm.conf" || return 1
  else grep -q '^ProctrackType=proctrack/linuxproc' "$CONF_DIR/slurm.conf" || return 1; fi
  if [[ $SLURM_ACCOUNTING == 1 ]]; then
    grep -q '^AccountingStorageType=accounting_storage/slurmdbd' "$CONF_DIR/slurm.conf" || return 1
    pid_alive /run/slurmdbd.pid slurmdbd || return 1
    timeout 10 sacct -n -X -S now-1minute >/dev/null 2>&1 || return 1
  else
    grep -q '^AccountingStorageType=accounting_storage/none' "$CONF_DIR/slurm.conf" || return 1
  fi
  return 0
}

[[ $(id -u) == 0 ]] || die "must run as root"

if healthy; then
  log "Slurm already running and healthy - nothing to do"
  sinfo >&2
  exit 0
fi

# ---------------------------------------------------------------- 1. packages
PKGS=(munge slurmctld slurmd slurm-client)
BINS=(munged slurmctld slurmd sbatch sinfo)
if [[ $SLURM_ACCOUNTING == 1 ]]; then
  PKGS+=(slurmdbd mariadb-server)
  BINS+=(slurmdbd mariadbd)
fi
missing=0
for b in "${BINS[@]}"; do command -v "$b" >/dev/null 2>&1 || [[ -x /usr/sbin/$b ]] || missing=1; done
if [[ $missing == 1 ]]; then
  log "installing ${PKGS[*]}"
  # keep package postinst scripts from trying to start the services (no systemd here)
  added_policy=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; added_policy=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q --no-install-recommends "${PKGS[@]}" >"$APTLOG" 2>&1; then
    log "apt-get install failed, running apt-get update and retrying"
    apt-get update -q >>"$APTLOG" 2>&1
    apt-get install -y -q --no-install-recommends "${PKGS[@]}" >>"$APTLOG" 2>&1 \
      || { tail -n 30 "$APTLOG" >&2; die "apt-get install failed"; }
  fi
  [[ $added_policy == 1 ]] && rm -f /usr/sbin/policy-rc.d
  log "packages installed ($(elapsed)s)"
fi

# ---------------------------------------------------------------- 2. clean leftovers
# something is half-up (or nothing is): stop whatever we own via PID files
bash "$HERE/stop.sh" --quiet || true

mkdir -p "$CONF_DIR" "$LOG_DIR" "$STATE_DIR" "$SPOOL_DIR"
if [[ $SLURM_FRESH == 1 ]]; then
  rm -rf "${STATE_DIR:?}"/* "${SPOOL_DIR:?}"/*
fi

# ---------------------------------------------------------------- 3. munge
if [[ ! -s /etc/munge/munge.key ]]; then
  log "creating munge key"
  mkdir -p /etc/munge
  if command -v mungekey >/dev/null 2>&1; then mungekey --create --keyfile=/etc/munge/munge.key --force
  else dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; fi
fi
chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge
chmod 0700 /etc/munge /var/log/munge; chmod 0400 /etc/munge/munge.key
mkdir -p /run/munge; chown munge:munge /run/munge; chmod 0755 /run/munge  # systemd's RuntimeDirectory
rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
runuser -u munge -- /usr/sbin/munged
wait_for 15 bash -c 'munge -n | unmunge' || die "munged did not come up (see /var/log/munge/munged.log)"
log "munged up, pid $(cat /run/munge/munged.pid)"

# ---------------------------------------------------------------- 4. slurm.conf
HW=$(slurmd -C | head -n1)          # e.g. NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 ...
hw() { sed -n "s/.* $1=\([0-9]*\).*/\1/p" <<<"$HW"; }
CPUS=$(hw CPUs); MEM=$(hw RealMemory)
NODE_LINE="NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS Boards=$(hw Boards) SocketsPerBoard=$(hw SocketsPerBoard) CoresPerSocket=$(hw CoresPerSocket) ThreadsPerCore=$(hw ThreadsPerCore) RealMemory=$MEM State=UNKNOWN"
EXTRA=""
if [[ -n ${SLURM_CPUS:-} ]]; then
  NODE_LINE="NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$SLURM_CPUS RealMemory=$MEM State=UNKNOWN"
  EXTRA="SlurmdParameters=config_overrides"
fi
if [[ $SLURM_CGROUP == 1 ]]; then
  TRACK="ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup,task/affinity
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000"
  printf 'CgroupPlugin=autodetect\nConstrainCores=yes\nConstrainRAMSpace=yes\nConstrainSwapSpace=no\n' >"$CONF_DIR/cgroup.conf"
else
  # no cgroups needed: plain /proc based process tracking, no task affinity/confinement
  TRACK="ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectTypeParameters=CR_Core"
  rm -f "$CONF_DIR/cgroup.conf"
fi
if [[ $SLURM_ACCOUNTING == 1 ]]; then
  ACCT="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30"
else
  ACCT="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
fi
cat >"$CONF_DIR/slurm.conf" <<EOF
# generated by scripts/slurm/start.sh - single-node CI cluster, no systemd
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_DIR
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
$TRACK
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SchedulerType=sched/backfill
$ACCT
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG_DIR/jobcomp.log
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=10
Waittime=0
$EXTRA
$NODE_LINE
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
log "wrote $CONF_DIR/slurm.conf ($NODE_LINE)"

# ---------------------------------------------------------------- 5. accounting
if [[ $SLURM_ACCOUNTING == 1 ]]; then
  if [[ ! -d /var/lib/mysql/mysql ]]; then
    log "initialising MariaDB datadir"
    mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
  fi
  mkdir -p /run/mysqld; chown mysql:mysql /run/mysqld
  setsid nohup /usr/sbin/mariadbd --user=mysql --bind-address=127.0.0.1 --skip-name-resolve \
    --pid-file=/run/mysqld/mysqld.pid --socket=/run/mysqld/mysqld.sock \
    --innodb-lock-wait-timeout=900 --innodb-buffer-pool-size=256M \
    >"$LOG_DIR/mariadb.log" 2>&1 </dev/null &
  wait_for 60 mariadb-admin --socket=/run/mysqld/mysqld.sock ping || die "mariadbd did not come up (see $LOG_DIR/mariadb.log)"
  wait_for 10 test -s /run/mysqld/mysqld.pid || true
  log "mariadbd up, pid $(cat /run/mysqld/mysqld.pid 2>/dev/null)"
  [[ $SLURM_FRESH == 1 ]] && mariadb -e "DROP DATABASE IF EXISTS $DB_NAME;"
  mariadb -e "CREATE DATABASE IF NOT EXISTS $DB_NAME;
    CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
    ALTER USER '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
    GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'localhost'; FLUSH PRIVILEGES;"
  cat >"$CONF_DIR/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
DebugLevel=info
LogFile=$LOG_DIR/slurmdbd.log
PidFile=/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=$DB_USER
StoragePass=$DB_PASS
StorageLoc=$DB_NAME
EOF
  chmod 600 "$CONF_DIR/slurmdbd.conf"   # slurmdbd refuses a world-readable file with a password
  /usr/sbin/slurmdbd
  wait_for 60 sacctmgr -n show cluster || die "slurmdbd did not come up"
  log "slurmdbd up, pid $(cat /run/slurmdbd.pid)"
  if [[ $'\n'"$(sacctmgr -n -P show cluster format=cluster)"$'\n' != *$'\n'"$CLUSTER"$'\n'* ]]; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null
  fi
else
  rm -f "$CONF_DIR/slurmdbd.conf"
fi

# ---------------------------------------------------------------- 6. slurmctld + slurmd
/usr/sbin/slurmctld            # daemonises itself (no -D)
wait_for 30 bash -c 'scontrol ping | grep -q "is UP"' || die "slurmctld did not come up"
log "slurmctld up, pid $(cat /run/slurmctld.pid)"
# -N: our NodeName is "localhost", not the machine's hostname
/usr/sbin/slurmd -N "$NODE"
wait_for 30 node_ready || {
  scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true
  wait_for 15 node_ready || die "node $NODE not ready: $(sinfo -h -n $NODE -o '%T %E')"
}
log "slurmd up, pid $(cat /run/slurmd.pid)"

if [[ $SLURM_SMOKE == 1 ]]; then
  timeout 60 srun -N1 -n1 -t 1 true || die "smoke test 'srun true' failed"
  log "smoke test 'srun true' ok"
fi
sinfo >&2
log "Slurm cluster ready in $(elapsed)s (accounting=$SLURM_ACCOUNTING cgroup=$SLURM_CGROUP)"
