#!/usr/bin/env bash
# A real two-node Ray cluster on one machine, a `ray job submit` of `dloco train` across two
# "regions", and a check of where the learners ran.
#
#   bash scripts/two_node_job.sh          (as root; exit 0 ok, 77 skipped, anything else failed)
#
# Design (why namespaces): Ray rewrites a node IP of 127.0.0.1 to the host's interface address
# unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, and with that setting `ray start --address` refuses
# to join. So each node gets its own Linux network namespace, joined by one veth pair whose two
# ends carry a private /30 that exists nowhere else:
#
#     netns dl2n-h-PID  [veth h0: 10.231.7.1/30] <====> [veth w0: 10.231.7.2/30]  netns dl2n-w-PID
#     Ray head:   GCS 10.231.7.1:6391, dashboard/job server 10.231.7.1:8271,
#                 node manager :6392, object manager :6393, custom resource {"region_a": 2}
#     Ray worker: node 10.231.7.2, node manager :6394, object manager :6395, {"region_b": 2}
#
# Neither namespace has the host's interface or a default route, so no Ray process can reach,
# advertise or be rewritten to the host's address; servers that bind 0.0.0.0 bind inside their
# namespace only. The veth ends are created directly inside the namespaces (nothing is added to
# the root namespace), and ports live per namespace, so the cluster cannot clash with another Ray
# session on this machine (e.g. a test suite's local cluster) or with a concurrent run of this
# script. `ray job submit` runs inside the head's namespace; the job's driver (`dloco train`)
# runs on the head and attaches through the RAY_ADDRESS the job server gives it.
#
# Auth: token authentication, as on a real cluster: one token (`ray get-auth-token --generate` on
# the head) copied into each node's ~/.ray/auth_token, and RAY_AUTH_MODE=token on every Ray command
# of both nodes and on the job submission. The job runs the README's command, `dloco train` (the
# venv's console script, by absolute path: the job's PATH is the head's).
#
# Cleanup: `ray stop --force` is NOT used: it kills every Ray process on the machine (it matches
# process names), including other Ray sessions. Instead every process inside this script's two
# namespaces (`ip netns pids`) is terminated, then killed, then the namespaces are deleted (which
# removes the veth pair) and the temp dir is removed. This runs on EXIT, INT and TERM, is
# idempotent, and at start-up namespaces left by a run whose PID is gone are cleaned as well.
#
# Env: PYTHON (default: `python` on PATH; the venv with ray and dloco), TWO_NODE_JOB_TIMEOUT
# (seconds for the job, default 360), TWO_NODE_JOB_KEEP=1 (keep the temp dir: Ray logs, job log,
# run dir; processes and namespaces are removed all the same).
#
# Data (issue: prepared once, verified everywhere): each node has its own HOME, so its own copy of
# the corpus (~/corpus, the same files on both) and its own corpus cache (~/dloco-cache). The job
# trains a BPE tokenizer on the driver (head); the worker's learner must tokenize with the driver's
# tokenizer, which it receives from the run (its cache says tokenizer_from "given"), and arrive at
# the driver's corpus key. A second job, after one of the worker's files is changed, must see the
# worker's learner refuse to start with one line while the head's learner trains on.
set -uo pipefail

log() { printf 'two_node_job: %s\n' "$*"; }
skip() { log "SKIP: $*"; exit 77; }
die() { log "FAIL: $*"; exit 1; }

START_S=$SECONDS
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONFIG_REL=cluster_configs/two_regions.yaml
PY=${PYTHON:-$(command -v python || command -v python3 || true)}
[ -n "$PY" ] && [ -x "$PY" ] || die "no python found (put the venv's bin first on PATH or set PYTHON)"
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")  # absolute: the job's entrypoint runs elsewhere
RAY="$(dirname "$PY")/ray"
DLOCO="$(dirname "$PY")/dloco"
[ -x "$DLOCO" ] || die "no dloco console script next to $PY (pip install -e . in that venv)"
[ -x "$RAY" ] || RAY=$(command -v ray || true)
[ -n "$RAY" ] || die "no ray CLI next to $PY or on PATH"
[ -f "$REPO/$CONFIG_REL" ] || die "missing $REPO/$CONFIG_REL"

HEAD_IP=10.231.7.1
WORKER_IP=10.231.7.2
GCS_PORT=6391
DASH_PORT=8271
HEAD_NM_PORT=6392
HEAD_OM_PORT=6393
CLIENT_PORT=6396
WORKER_NM_PORT=6394
WORKER_OM_PORT=6395
JOB_TIMEOUT=${TWO_NODE_JOB_TIMEOUT:-360}
NS_H=dl2n-h-$$
NS_W=dl2n-w-$$
WORK=""
CHILD=""
CLEANED=""

# ---- privileges ---------------------------------------------------------------------------------
[ "$(id -u)" = 0 ] || skip "needs root for network namespaces (ip netns); not root"
command -v ip >/dev/null 2>&1 || skip "needs the 'ip' command (iproute2) for network namespaces"

# ---- cleanup ------------------------------------------------------------------------------------
ns_exists() { [ -e "/run/netns/$1" ]; }

kill_ns() {  # every process inside namespace $1: TERM, then KILL
  local ns=$1 pids i
  ns_exists "$ns" || return 0
  pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
  [ -n "${pids// /}" ] || return 0
  kill -TERM $pids 2>/dev/null
  for i in $(seq 1 50); do
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    [ -n "${pids// /}" ] || return 0
    sleep 0.1
  done
  kill -KILL $pids 2>/dev/null
  for i in $(seq 1 50); do
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    [ -n "${pids// /}" ] || return 0
    sleep 0.1
  done
  log "warning: processes still in $ns after SIGKILL: $pids"
}

drop_ns() { kill_ns "$1"; ns_exists "$1" && ip netns del "$1" 2>/dev/null; return 0; }

cleanup() {
  [ -n "$CLEANED" ] && return 0
  CLEANED=1
  trap '' INT TERM  # finish cleaning even if interrupted again
  [ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null
  drop_ns "$NS_W"
  drop_ns "$NS_H"
  if [ -n "$WORK" ]; then
    if [ -n "${TWO_NODE_JOB_KEEP:-}" ] && mv "$WORK" "/tmp/dl2n-kept-$$" 2>/dev/null; then
      log "kept /tmp/dl2n-kept-$$ (Ray logs, job log, run dir)"
    else
      rm -rf "$WORK"
    fi
  fi
  return 0
}
trap 'cleanup' EXIT
trap 'log "interrupted"; cleanup; exit 130' INT
trap 'log "terminated"; cleanup; exit 143' TERM

# Namespaces of earlier runs that were killed outright (SIGKILL skips traps): their PID is gone.
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^dl2n-[hw]-[0-9]+$'); do
  kill -0 "${ns##*-}" 2>/dev/null || { log "removing stale namespace $ns"; drop_ns "$ns"; }
done
for d in /tmp/dl2n-[0-9]*-*; do
  [ -d "$d" ] || continue
  pid=${d#/tmp/dl2n-}
  pid=${pid%%-*}
  case $pid in '' | *[!0-9]*) continue ;; esac
  kill -0 "$pid" 2>/dev/null || { log "removing stale temp dir $d"; rm -rf "$d"; }
done

# `run_waiting LOG CMD...`: runs CMD in the background with its output in LOG and waits for it, so
# INT/TERM reach the trap at once (and the trap's own output is not redirected into LOG).
run_waiting() {
  local out=$1
  shift
  "$@" >"$out" 2>&1 &
  CHILD=$!
  wait "$CHILD"
  local rc=$?
  CHILD=""
  return $rc
}

# ---- network: two namespaces and a veth pair ----------------------------------------------------
ip netns add "$NS_H" 2>/dev/null || skip "cannot create network namespaces (ip netns add failed: no privilege?)"
ip netns add "$NS_W" 2>/dev/null || skip "cannot create a second network namespace"
ip link add h0 netns "$NS_H" type veth peer name w0 netns "$NS_W" 2>/dev/null ||
  skip "cannot create a veth pair between namespaces (no veth support?)"
ip -n "$NS_H" link set lo up && ip -n "$NS_W" link set lo up &&
  ip -n "$NS_H" addr add "$HEAD_IP/30" dev h0 && ip -n "$NS_W" addr add "$WORKER_IP/30" dev w0 &&
  ip -n "$NS_H" link set h0 up && ip -n "$NS_W" link set w0 up || die "cannot configure the veth pair"
log "network: $NS_H h0 $HEAD_IP/30 <-> $NS_W w0 $WORKER_IP/30"

WORK=$(mktemp -d "/tmp/dl2n-$$-XXXX")  # short: Ray's unix socket paths live under it
RUN_DIR=$WORK/run
mkdir -p "$WORK/h" "$WORK/w" "$WORK/home-h/corpus" "$WORK/home-w/corpus"
# The same documents on both nodes: standard-library modules, as text files.
"$PY" - "$WORK/home-h/corpus" "$WORK/home-w/corpus" <<'PYEOF' || die "cannot write the nodes' corpora"
import pathlib, shutil, sys, sysconfig
src = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("[a-f]*.py"))
for dest in sys.argv[1:]:
    for f in src:
        shutil.copyfile(f, pathlib.Path(dest) / (f.stem + ".txt"))
PYEOF
DATA_SET=(--set 'data.source=text:~/corpus/*.txt' --set data.tokenizer=bpe --set data.vocab_size=512
  --set 'data.cache_dir=~/dloco-cache')

# Every Ray command: the same auth mode, no usage stats, no RAY_ADDRESS of the caller. Cluster mode
# stays on (=1): inside the namespaces the only non-loopback address is the veth one.
RAY_ENV=(env -u RAY_ADDRESS -u RAY_AUTH_TOKEN -u RAY_AUTH_TOKEN_PATH RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0
  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 JAX_PLATFORMS=cpu TF_CPP_MIN_LOG_LEVEL=3)
IN_H=(ip netns exec "$NS_H" "${RAY_ENV[@]}" HOME="$WORK/home-h")
IN_W=(ip netns exec "$NS_W" "${RAY_ENV[@]}" HOME="$WORK/home-w")

diagnose() {
  local d f
  for d in "$WORK/h" "$WORK/w"; do
    for f in "$d"/session_latest/logs/{gcs_server.err,raylet.err,raylet.out,dashboard.err}; do
      [ -s "$f" ] && { echo "---- tail $f"; tail -n 15 "$f"; }
    done
  done
  [ -s "$WORK/job.log" ] && { echo "---- tail job log"; tail -n 40 "$WORK/job.log"; }
  return 0
}

# ---- the cluster's token, on both nodes ---------------------------------------------------------
run_waiting "$WORK/token.log" timeout 60 "${IN_H[@]}" "$RAY" get-auth-token --generate ||
  { cat "$WORK/token.log"; die "ray get-auth-token --generate failed"; }
[ -s "$WORK/home-h/.ray/auth_token" ] || die "no token in the head's ~/.ray/auth_token"
mkdir -p "$WORK/home-w/.ray" && chmod 700 "$WORK/home-h/.ray" "$WORK/home-w/.ray" &&
  install -m 600 "$WORK/home-h/.ray/auth_token" "$WORK/home-w/.ray/auth_token" || die "cannot copy the token"

# ---- Ray head and worker ------------------------------------------------------------------------
log "starting Ray head on $HEAD_IP (GCS :$GCS_PORT, job server :$DASH_PORT)"
run_waiting "$WORK/head.log" timeout 120 "${IN_H[@]}" \
  "$RAY" start --head --node-ip-address="$HEAD_IP" --port="$GCS_PORT" \
  --node-manager-port="$HEAD_NM_PORT" --object-manager-port="$HEAD_OM_PORT" \
  --ray-client-server-port="$CLIENT_PORT" \
  --include-dashboard=true --dashboard-host="$HEAD_IP" --dashboard-port="$DASH_PORT" \
  --num-cpus=1 --resources='{"region_a": 2}' --object-store-memory=268435456 \
  --temp-dir="$WORK/h" --disable-usage-stats ||
  { cat "$WORK/head.log"; diagnose; die "ray start --head failed"; }

log "starting Ray worker on $WORKER_IP, joining $HEAD_IP:$GCS_PORT"
run_waiting "$WORK/worker.log" timeout 120 "${IN_W[@]}" \
  "$RAY" start --address="$HEAD_IP:$GCS_PORT" --node-ip-address="$WORKER_IP" \
  --node-manager-port="$WORKER_NM_PORT" --object-manager-port="$WORKER_OM_PORT" \
  --num-cpus=1 --resources='{"region_b": 2}' --object-store-memory=268435456 \
  --temp-dir="$WORK/w" --disable-usage-stats ||
  { cat "$WORK/worker.log"; diagnose; die "ray start --address (worker) failed"; }

joined=""
for _ in $(seq 1 30); do
  if run_waiting "$WORK/status.log" timeout 30 "${IN_H[@]}" "$RAY" status --address="$HEAD_IP:$GCS_PORT" &&
    grep -q region_b "$WORK/status.log" && grep -q region_a "$WORK/status.log"; then
    joined=1
    break
  fi
  sleep 2
done
[ -n "$joined" ] || { cat "$WORK/status.log"; diagnose; die "the worker did not join the head within ~60 s"; }
log "cluster up: 2 nodes, resources region_a (head) and region_b (worker)"

# ---- the job ------------------------------------------------------------------------------------
# .git is excluded by Ray; the rest is excluded here (runs/ and caches can be large).
EXCLUDES='{"excludes": ["runs/", ".hypothesis/", ".pytest_cache/", ".ruff_cache/", "benchmarks/results/", "*.egg-info/", "__pycache__/", ".venv/", "venv/"]}'
submit() {  # submit LOG RUN_DIR [ARGS...]: the job, from inside the head's namespace
  local out=$1 run_dir=$2
  shift 2
  run_waiting "$out" timeout "$JOB_TIMEOUT" "${IN_H[@]}" \
    "$RAY" job submit --address="http://$HEAD_IP:$DASH_PORT" \
    --working-dir="$REPO" --runtime-env-json="$EXCLUDES" -- \
    "$DLOCO" train --config "$CONFIG_REL" "${DATA_SET[@]}" --run-dir "$run_dir" --quiet "$@"
}
log "submitting: $DLOCO train --config $CONFIG_REL ${DATA_SET[*]} (token auth; timeout ${JOB_TIMEOUT}s)"
job_start=$SECONDS
submit "$WORK/job.log" "$RUN_DIR"
job_rc=$?
job_s=$((SECONDS - job_start))
if [ "$job_rc" != 0 ]; then
  diagnose
  [ "$job_rc" = 124 ] && die "the job did not finish within ${JOB_TIMEOUT}s"
  die "ray job submit exited with $job_rc"
fi
[ -s "$RUN_DIR/summary.json" ] || { diagnose; die "the job ended without $RUN_DIR/summary.json"; }

# The driver's own output (dloco's summary table), without the job client's log lines.
log "job output (dloco train on the head, ${job_s}s incl. upload):"
awk '/^Running entrypoint/ {on = 1; next} on && !/^[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] / {print "    " $0}' "$WORK/job.log"

# ---- verification -------------------------------------------------------------------------------
HEAD_IP=$HEAD_IP WORKER_IP=$WORKER_IP JOB_S=$job_s TOTAL_S=$((SECONDS - START_S)) WORK=$WORK \
  "$PY" - "$RUN_DIR/summary.json" <<'PYEOF'
import glob, json, os, sys

s = json.load(open(sys.argv[1]))
head, worker = os.environ["HEAD_IP"], os.environ["WORKER_IP"]
placement = {int(k): v for k, v in (s.get("placement") or {}).items()}
groups = {0: "a", 1: "b"}
print(f"{'learner':>7}  {'group':<5}  {'node ip':<12}  {'node id':<14}  resources")
for m in sorted(placement):
    p = placement[m] or {}
    res = ", ".join(f"{k}={v:g}" for k, v in sorted((p.get("resources") or {}).items()))
    print(f"{m:>7}  {groups.get(m, '?'):<5}  {p.get('ip', '?'):<12}  {str(p.get('node_id', '?'))[:12]:<14}  {res}")
print(f"merges {s['merges']}  eval loss {s['eval_loss_start']:.3f} -> {s['eval_loss_end']:.3f}  "
      f"tokens {s['tokens_trained']:,}  run {s['wall_time_s']:.1f}s  job {os.environ['JOB_S']}s  "
      f"script so far {os.environ['TOTAL_S']}s")
errors = []
want = {0: head, 1: worker}
for m, ip in want.items():
    got = (placement.get(m) or {}).get("ip")
    if got != ip:
        errors.append(f"learner {m} ran on {got!r}, expected {ip} ({'head' if m == 0 else 'worker'})")
nodes = {(placement.get(m) or {}).get("node_id") for m in want}
if len(nodes) != 2:
    errors.append(f"learners 0 and 1 did not run on two different nodes: {nodes}")
if not s["merges"] > 0:
    errors.append(f"no merges (merges={s['merges']})")
if s.get("auth_mode") != "token":
    errors.append(f"the run's cluster had auth mode {s.get('auth_mode')!r}, expected token")
if not s["eval_loss_end"] < s["eval_loss_start"]:
    errors.append(f"eval loss did not fall: {s['eval_loss_start']:.4f} -> {s['eval_loss_end']:.4f}")
# Each node's corpus cache: the head's BPE was trained there, the worker's came from the driver.
caches = {}
for node in ("h", "w"):
    metas = [json.load(open(p)) for p in glob.glob(f"{os.environ['WORK']}/home-{node}/dloco-cache/*/meta.json")]
    caches[node] = metas[0] if len(metas) == 1 else None
    if len(metas) != 1:
        errors.append(f"node {node}: {len(metas)} corpora in its cache, expected 1")
if caches["h"] and caches["w"]:
    h, w = caches["h"], caches["w"]
    print(f"corpus key {h['key'][:16]}: head tokenizer {h['tokenizer_from']}, worker tokenizer {w['tokenizer_from']}")
    if (h["tokenizer_from"], w["tokenizer_from"]) != ("trained", "given"):
        errors.append(f"tokenizer_from head {h['tokenizer_from']!r}, worker {w['tokenizer_from']!r}: "
                      "expected 'trained' on the driver's node and 'given' on the worker")
    if h["key"] != w["key"]:
        errors.append(f"corpus keys differ: head {h['key'][:16]}, worker {w['key'][:16]}")
for e in errors:
    print(f"two_node_job: FAIL: {e}")
if errors:
    sys.exit(1)
print(f"two_node_job: OK: learner 0 on head {head}, learner 1 on worker {worker}, "
      f"{s['merges']} merges, eval loss {s['eval_loss_start']:.3f} -> {s['eval_loss_end']:.3f}, "
      "the worker tokenized with the driver's tokenizer, token auth")
PYEOF
rc=$?
[ "$rc" = 0 ] || { diagnose; exit 1; }

# ---- a node whose corpus differs is refused -----------------------------------------------------
first=$(cd "$WORK/home-w/corpus" && ls | sort | head -n 1)
printf '\n# a line only the worker has\n' >>"$WORK/home-w/corpus/$first"
log "changed the worker's copy of $first; submitting again"
submit "$WORK/job2.log" "$WORK/run2" --set budget.tokens=8000
job2_rc=$?
[ -s "$WORK/run2/metrics.jsonl" ] || { cat "$WORK/job2.log"; die "the second job (rc $job2_rc) wrote no metrics"; }
"$PY" - "$WORK/run2/metrics.jsonl" <<'PYEOF'
import json, sys

events = [json.loads(line) for line in open(sys.argv[1])]
errors = [e for e in events if e["event"] == "actor_error" and e["target"] == "learner-1"]
started = sorted({e["learner"] for e in events if e["event"] == "learner_start"})
merges = sum(e["event"] == "merge" for e in events)
if len(errors) == 1:
    print(f"    learner-1: {errors[0]['error']}")
problems = []
if len(errors) != 1 or "learner 1: its corpus differs from the driver's" not in errors[0]["error"]:
    problems.append(f"expected one 'learner 1: its corpus differs from the driver's' error, got {errors}")
elif "\n" in errors[0]["error"]:
    problems.append("the refusal is more than one line")
if started != [0] or not merges:
    problems.append(f"expected learner 0 alone to start and merge: started {started}, {merges} merges")
for p in problems:
    print(f"two_node_job: FAIL: {p}")
if problems:
    sys.exit(1)
print(f"two_node_job: OK: the worker with a changed corpus was refused; learner 0 merged {merges} times alone")
PYEOF
[ $? = 0 ] || { tail -n 40 "$WORK/job2.log"; exit 1; }
log "done in $((SECONDS - START_S)) s (cleanup follows)"
exit 0
