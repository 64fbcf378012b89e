#!/usr/bin/env bash
# Installs every Debian 12 package that megacpp's build, tests and demo need.
# Idempotent and non-interactive: packages already present are not reinstalled,
# and apt is only consulted when something is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git ca-certificates
  libopenblas-dev
  libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev
  libsqlite3-dev sqlite3
  libspdlog-dev libfmt-dev
  nlohmann-json3-dev libcpp-httplib-dev libcli11-dev
  prometheus-cpp-dev
  # The metrics test starts its own Prometheus server (a temporary config, a free loopback port).
  prometheus
  # The web page test loads the daemon's page in headless Chromium and screenshots it.
  chromium
  libgtest-dev libgmock-dev libbenchmark-dev
  clang-format python3
  # The Python client (python/megacpp_client): its modules are generated from proto/ by protoc and
  # grpc_python_plugin above (python3-grpc-tools bundles a protoc too old for proto3 `optional`).
  python3-grpcio python3-protobuf
  # megacpp data prepare --tokenizer MODEL; spm_train makes the tests' small model.
  libsentencepiece-dev sentencepiece
  clang-14 libclang-rt-14-dev libomp-14-dev
  openssl
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -q
"${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
