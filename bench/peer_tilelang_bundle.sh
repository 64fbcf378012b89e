#!/usr/bin/env bash
# Rebuild the TileLang bundle used to time the official Mamba-3 MIMO TileLang
# kernels as a peer (the MIMO TileLang rows of bench/RESULTS.md). It is a
# benchmarking aid only and never a dependency of the product's build.
#
# The GPU machine has no network access, so the wheels are fetched here and
# unpacked into one site-packages tree (Python 3.12, manylinux x86_64). Pins:
#   tilelang 0.1.8          state-spaces/mamba pins it; >= 0.1.13 fails to
#                           compile mamba_mimo_bwd_bwd_kernel ("ReduceOp cannot
#                           lower a layout where a source index depends on a
#                           thread-owned reduce segment").
#   apache-tvm-ffi 0.1.9    tilelang 0.1.8 breaks with >= 0.1.10
#                           (state-spaces/mamba issue 907, PR 995).
#   torch-c-dlpack-ext 0.1.5, z3-solver 4.15.4.0: runtime deps, frozen at the
#                           versions the RESULTS.md numbers were taken with.
# Pruned to stay small: TileLang's AMD-only composable_kernel tree (an empty
# include dir is kept), z3's command-line binary (its wheel's .data dir),
# __pycache__, and the stray top-level build_backend.py of torch-c-dlpack-ext.
#
# On the device, with the tarball and the peer folder (.peer/) carried:
#   mkdir -p /tmp/tlpk && tar xJf X -C /tmp/tlpk
#   cd .peer && PYTHONPATH=/tmp/tlpk python3 run_peers.py mimo
#
# Usage: bench/peer_tilelang_bundle.sh OUT.tar.xz
set -euo pipefail

[[ $# -eq 1 ]] || { echo "usage: $0 OUT.tar.xz" >&2; exit 2; }
out=$(realpath -m -- "$1")
# Made now: the final mv needs it, after minutes of downloads and xz -9 (.tl/ in a fresh checkout).
mkdir -p -- "$(dirname -- "$out")"
pins=(tilelang==0.1.8 apache-tvm-ffi==0.1.9 torch-c-dlpack-ext==0.1.5 z3-solver==4.15.4.0)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/wheels" "$tmp/site"

for pin in "${pins[@]}"; do
  # pip prefers the earlier --platform: newest first, so apache-tvm-ffi resolves
  # to its 2_28 build (as measured) rather than its 2014 one.
  pip download --quiet --only-binary=:all: --no-deps --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$tmp/wheels" "$pin" \
    || { echo "error: pip download failed for $pin" >&2; exit 1; }
done

# unzip keeps the wheels' file modes (executable .so); zipfile is the fallback.
for whl in "$tmp"/wheels/*.whl; do
  if command -v unzip >/dev/null; then unzip -qo "$whl" -d "$tmp/site"
  else python3 -m zipfile -e "$whl" "$tmp/site"; fi
done

site=$tmp/site
rm -rf "${site:?}"/tilelang/3rdparty/composable_kernel "$site"/z3_solver-*.data \
  "$site/build_backend.py"
mkdir -p "$site/tilelang/3rdparty/composable_kernel/include"
find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +

# -9: the tarball is carried to the device on every run, so size beats time here.
XZ_OPT=-9 tar -C "$site" --sort=name --owner=0 --group=0 --numeric-owner \
  -cJf "$tmp/out.tar.xz" .
mv -f "$tmp/out.tar.xz" "$out"
echo "wrote $out ($(du -h "$out" | cut -f1))"
