#!/usr/bin/env bash
# Launch train_ddp.py with torchrun, restarting failed workers; extra arguments go to the script.
#
#   ./run_ddp.sh                                   # one node: every GPU, or 2 CPU processes
#   ./run_ddp.sh --model small --max-steps 5000    # flags pass through to train_ddp.py
#
# Several nodes (c10d rendezvous): run the same command on every node, with NODE_RANK 0 on the
# node whose address is MASTER_ADDR (it hosts the rendezvous store):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./run_ddp.sh     # on 10.0.0.1
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 ./run_ddp.sh     # on the other node
#
# Environment (defaults in brackets): NPROC_PER_NODE [GPUs on this node, or 2 without GPUs],
# NNODES [1], NODE_RANK [0], MASTER_ADDR [127.0.0.1], MASTER_PORT [29500], MAX_RESTARTS [3],
# RDZV_ID [llama] (the same on every node of one job), SCRIPT [train_ddp.py], SHUTDOWN_TIMEOUT
# [120] (seconds torchrun gives its workers to stop on a signal, see below), GLOO_SOCKET_IFNAME
# and NCCL_SOCKET_IFNAME [lo on one node; gloo's on several: see below].
#
# Two jobs on one machine need two MASTER_PORTs: a port another job holds is refused before
# torchrun starts.
#
# After a failure torchrun restarts every worker (up to MAX_RESTARTS times); the script then
# resumes from the latest checkpoint in --out-dir by itself (--resume auto is the default).
set -euo pipefail
# The script from this folder; relative paths in the flags (--data, --out-dir, --cache-dir) from
# wherever this is run, as for any other command.
script="$(cd "$(dirname "$0")" && pwd)/${SCRIPT:-train_ddp.py}"

# The numbers of the environment, checked before they reach bash's arithmetic (which reads
# NPROC_PER_NODE=abc as a variable's name) or torchrun: a mistake is one line, exit code 2.
need() {  # need NAME VALUE MIN [MAX [RANGE]]: VALUE is a decimal integer from MIN (to MAX)
  local name=$1 value=$2 min=$3 max=${4:-999999999} range=${5:-}
  if [[ -z "$range" ]]; then
    range="an integer >= $min"
    if [[ -n "${4:-}" ]]; then range="an integer from $min to $max"
    elif (( min == 1 )); then range="a positive integer"; fi
  fi
  if ! [[ "$value" =~ ^[0-9]{1,9}$ ]] || (( 10#$value < min || 10#$value > max )); then
    echo "error: $name must be $range, got '$value'" >&2
    exit 2
  fi
  printf -v "$name" '%d' "$((10#$value))"  # 08 is 8 (bash and torchrun would read octal)
}
[[ -z "${NPROC_PER_NODE:-}" ]] || need NPROC_PER_NODE "$NPROC_PER_NODE" 1
need NNODES "${NNODES:-1}" 1
last=$((NNODES - 1))
need NODE_RANK "${NODE_RANK:-0}" 0 "$last" "an integer from 0 to NNODES - 1 = $last"
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
need MASTER_PORT "${MASTER_PORT:-29500}" 1 65535
need MAX_RESTARTS "${MAX_RESTARTS:-3}" 0
need SHUTDOWN_TIMEOUT "${SHUTDOWN_TIMEOUT:-120}" 1

if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  gpus=$(python -c "import torch; print(torch.cuda.device_count())")
  NPROC_PER_NODE=$(( gpus > 0 ? gpus : 2 ))
fi

# Say explicitly which node hosts the rendezvous store, instead of letting torchrun guess it by
# comparing host names with MASTER_ADDR (which fails behind NAT or with several interfaces).
if [[ "$NODE_RANK" == 0 ]]; then is_host=true; else is_host=false; fi

# The host's rendezvous store listens on MASTER_PORT, on every IPv4 interface: a port another job
# holds would end torchrun in a 40-line traceback (EADDRINUSE). Bound here as the store binds it
# (SO_REUSEADDR: a port left in TIME_WAIT by a job that ended is free), and let go at once.
if [[ "$is_host" == true ]]; then
  why=$(python -c '
import errno, socket, sys
with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", int(sys.argv[1])))
    except OSError as e:
        print("in use" if e.errno == errno.EADDRINUSE else e.strerror.lower())
' "$MASTER_PORT")
  if [[ "$why" == "in use" ]]; then
    echo "error: MASTER_PORT $MASTER_PORT is in use on this node: another job holds it (another" \
      "run_ddp.sh or torchrun?); set MASTER_PORT to a free port" >&2
    exit 2
  elif [[ -n "$why" ]]; then
    echo "error: MASTER_PORT $MASTER_PORT cannot be listened on here ($why); set MASTER_PORT to" \
      "a free port above 1023" >&2
    exit 2
  fi
fi

# One node: keep the collectives' own connections on the loopback interface. (torch's TCPStore,
# which the rendezvous uses, listens on every interface whatever MASTER_ADDR says: see
# docs/running.md's security note.)
if [[ "$NNODES" == 1 ]]; then
  loopback=lo; [[ "$(uname)" == Darwin ]] && loopback=lo0
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$loopback}
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$loopback}
else
  # Several nodes: gloo (CPU tensors, and --async-save's own group even with NCCL) otherwise
  # binds the address this node's host name resolves to, which on a cluster may be an interface
  # the other nodes cannot reach (a management network, a container bridge, 127.0.1.1): its
  # connections then hang. It takes NCCL_SOCKET_IFNAME when that names one interface (not a
  # prefix or a ^exclusion, which gloo cannot read), else the interface this node reaches
  # MASTER_ADDR through; NCCL keeps its own choice unless NCCL_SOCKET_IFNAME is set. Set
  # GLOO_SOCKET_IFNAME to choose it yourself.
  if [[ -z "${GLOO_SOCKET_IFNAME:-}" ]]; then
    GLOO_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-}
    if ! [[ -e "/sys/class/net/$GLOO_SOCKET_IFNAME" && "$GLOO_SOCKET_IFNAME" =~ ^[^,^=]+$ ]]; then
      GLOO_SOCKET_IFNAME=$(python -c '
import fcntl, socket, struct, sys
# The address this node sends from to reach MASTER_ADDR (a UDP "connection" sends nothing),
# then the interface that holds it (SIOCGIFADDR, Linux).
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.connect((sys.argv[1], 9))
    address = s.getsockname()[0]
    for _, name in socket.if_nameindex():
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        except OSError:  # no IPv4 address
            continue
        if socket.inet_ntoa(packed[20:24]) == address:
            print(name)
            break
' "$MASTER_ADDR" 2>/dev/null || true)
    fi
    if [[ -z "$GLOO_SOCKET_IFNAME" ]]; then
      echo "error: no network interface of this node reaches MASTER_ADDR $MASTER_ADDR; set" \
        "GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) to the one the nodes talk over" >&2
      exit 2
    fi
  fi
  export GLOO_SOCKET_IFNAME
fi

# Check the flags once, first: torchrun restarts the workers whatever made them fail, so a typo
# would fail MAX_RESTARTS + 1 times over. One process (no RANK), told the job's world size as
# torchrun will tell the workers; a mistake ends here with its one-line message and exit code 2.
env -u RANK -u LOCAL_RANK WORLD_SIZE=$((NNODES * NPROC_PER_NODE)) \
  LOCAL_WORLD_SIZE="$NPROC_PER_NODE" python "$script" "$@" --check >/dev/null

# On SIGTERM, SIGINT or SIGUSR1 (slurm_ddp.sbatch's early warning; without this flag it would
# kill torchrun) torchrun passes the signal to its workers, which finish their step, save a
# checkpoint and exit; it SIGKILLs them after --shutdown-timeout, so that must cover a step and a
# save. (It also gives the survivors of a failed worker that long to stop before a restart.)
# torchrun's --shutdown-timeout came with torch 2.13 (the suite's other version checks are in
# lib/distributed.py); before it the time is fixed at 30 s.
shutdown_timeout=(--shutdown-timeout="$SHUTDOWN_TIMEOUT")
if [[ "$(torchrun --help 2>/dev/null || true)" != *--shutdown-timeout* ]]; then
  echo "note: this torchrun (torch before 2.13) gives its workers a fixed 30 s to stop, not" \
    "SHUTDOWN_TIMEOUT=$SHUTDOWN_TIMEOUT s: a step and a save must fit in 30 s" >&2
  shutdown_timeout=()
fi
set -x
exec torchrun \
  --nnodes="$NNODES" \
  --nproc-per-node="$NPROC_PER_NODE" \
  --rdzv-backend=c10d \
  --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" \
  --rdzv-id="${RDZV_ID:-llama}" \
  --rdzv-conf="is_host=$is_host" \
  --max-restarts="$MAX_RESTARTS" \
  --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
  ${shutdown_timeout[@]+"${shutdown_timeout[@]}"} \
  "$script" "$@"
