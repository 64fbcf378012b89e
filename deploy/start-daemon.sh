# Sourced by the GPU-machine scripts: start_megacppd LOG starts megacppd (on PATH) with
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
