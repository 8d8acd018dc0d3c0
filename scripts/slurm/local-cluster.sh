#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, from Debian's packages, for testing the
# workflow's SLURM profile (workflow/profiles/slurm-local). Run as root.
#
#   scripts/slurm/local-cluster.sh           install (if needed), configure, start; wait for an idle node
#   scripts/slurm/local-cluster.sh --stop    stop slurmd, slurmctld and the munged this script started
#   scripts/slurm/local-cluster.sh --status  show the daemons and sinfo
#
# The node has this machine's CPUs (nproc) and 90% of its memory, no GPUs. There is no
# slurmdbd (no accounting), so job states come from squeue: MinJobAge=3600 keeps finished
# jobs visible to it for an hour, and the profile sets slurm-status-command: squeue.
# State, logs and pid files live under $DPBENCH_SLURM_DIR (default /var/lib/dpbench-slurm);
# /etc/slurm/slurm.conf is written only if absent or written by this script before.
set -euo pipefail

STATE="${DPBENCH_SLURM_DIR:-/var/lib/dpbench-slurm}"
CONF=/etc/slurm/slurm.conf
MARKER="# written by dpbench scripts/slurm/local-cluster.sh"
RUN="$STATE/run"
LOG="$STATE/log"

die() { echo "local-cluster: $*" >&2; exit 1; }
say() { echo "local-cluster: $*" >&2; }

[ "$(id -u)" -eq 0 ] || die "must run as root (it installs packages and starts daemons)"

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_pidfile() {  # stop the daemon whose pid file is $1, waiting up to 20 s
    local file="$1" name="$2" pid
    if pid_alive "$file"; then
        pid="$(cat "$file")"
        say "stopping $name (pid $pid)"
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$pid" 2>/dev/null && { say "$name did not stop, killing it"; kill -9 "$pid" 2>/dev/null || true; }
    fi
    rm -f "$file"
}

stop() {
    stop_pidfile "$RUN/slurmd.pid" slurmd
    stop_pidfile "$RUN/slurmctld.pid" slurmctld
    stop_pidfile "$RUN/munged.pid" munged
    say "stopped"
}

status() {
    for d in munged slurmctld slurmd; do
        if pid_alive "$RUN/$d.pid"; then echo "$d: running (pid $(cat "$RUN/$d.pid"))"; else echo "$d: stopped"; fi
    done
    command -v sinfo >/dev/null && pid_alive "$RUN/slurmctld.pid" && sinfo || true
}

case "${1:-}" in
    --stop) stop; exit 0 ;;
    --status) status; exit 0 ;;
    "") ;;
    *) die "unknown option $1 (use --stop or --status)" ;;
esac

# --- packages
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    say "installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq slurm-wlm munge >/dev/null
fi

# --- configuration
mkdir -p "$STATE/state" "$STATE/spool" "$RUN" "$LOG" /etc/slurm
if [ -e "$CONF" ] && ! grep -qF "$MARKER" "$CONF"; then
    die "$CONF exists and was not written by this script; refusing to overwrite it"
fi
HOST="$(hostname -s)"
CPUS="$(nproc)"
MEM_MB="$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)"
cat > "$CONF" <<EOF
$MARKER
# A single node, no accounting database, no cgroups: for testing workflows only.
ClusterName=dpbench
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
# finished jobs stay visible to squeue for an hour (no slurmdbd, so no sacct)
MinJobAge=3600
SlurmdTimeout=300
InactiveLimit=0
KillWait=30
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF

# --- munge
if ! pid_alive "$RUN/munged.pid"; then
    if [ ! -s /etc/munge/munge.key ]; then
        say "creating /etc/munge/munge.key"
        if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key
        else dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none; fi
    fi
    chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
    say "starting munged"
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
    cp /run/munge/munged.pid "$RUN/munged.pid"  # ours: --stop stops only what this script started
fi
munge -n | unmunge >/dev/null || die "munge does not work (see /var/log/munge/munged.log)"

# --- slurm daemons
if ! pid_alive "$RUN/slurmctld.pid"; then
    say "starting slurmctld"
    /usr/sbin/slurmctld -c -f "$CONF"  # -c: start with an empty queue
fi
if ! pid_alive "$RUN/slurmd.pid"; then
    say "starting slurmd"
    /usr/sbin/slurmd -f "$CONF"
fi

say "waiting for node $HOST to become idle"
for i in $(seq 60); do
    state="$(sinfo -h -n "$HOST" -o %T 2>/dev/null || true)"
    case "$state" in
        idle*) say "node $HOST is $state ($CPUS CPUs, ${MEM_MB} MB)"; sinfo; exit 0 ;;
        down*|drain*|unknown*|inval*) [ $((i % 5)) -eq 0 ] && scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;;
    esac
    sleep 1
done
tail -n 20 "$LOG/slurmctld.log" "$LOG/slurmd.log" >&2 || true
die "node $HOST did not become idle in 60 s (state: ${state:-none}); logs above, stop with --stop"
