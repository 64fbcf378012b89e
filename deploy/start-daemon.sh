# Sourced by the GPU-machine scripts, from the repository's root.
#
# fresh_corpus NAME INPUT LOGDIR empties the daemon's state/ and prepares INPUT's files as the
# byte-token corpus data/NAME_train and data/NAME_valid (a tenth held out), logging to
# LOGDIR/prepare.log.
fresh_corpus() {
  local name=$1 input=$2 logdir=$3
  rm -rf state "data/$name"*
  mkdir -p state data
  megacpp data prepare --input "$input" --output "data/$name" --seed 1 --valid-fraction 0.1 \
    > "$logdir/prepare.log"
}

# start_megacppd LOG starts megacppd (on PATH) with
# configs/daemon.json in the background, stops it when the calling script exits, waits up to
# 30 s for its state/daemon.json (printing LOG's tail and failing if it dies first) and points
# the CLI at it.
start_megacppd() {
  local log=$1
  megacppd --config configs/daemon.json > "$log" 2>&1 &
  daemon=$!
  trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null || true' EXIT
  for _ in $(seq 1 300); do
    [ -f state/daemon.json ] && break
    kill -0 $daemon 2>/dev/null || { tail -20 "$log"; exit 1; }
    sleep 0.1
  done
  export MEGACPP_DAEMON=127.0.0.1:50551
}
