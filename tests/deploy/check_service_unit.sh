#!/usr/bin/env bash
# Checks deploy/megacppd.service with `systemd-analyze verify` and that its hardening stays in
# place. Usage: check_service_unit.sh UNIT_FILE MEGACPPD_BINARY. Exits 77 (ctest: skipped) where
# systemd-analyze is not installed.
set -euo pipefail
unit=$1
daemon=$2
if ! command -v systemd-analyze >/dev/null; then
  echo "systemd-analyze is missing (Debian package systemd): not checking $unit"
  exit 77
fi

# verify also checks that ExecStart's binary exists: point it at the one just built. The copy
# keeps the unit's name, which verify requires to match its type.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
sed "s|^ExecStart=/usr/local/bin/megacppd |ExecStart=$daemon |" "$unit" >"$scratch/megacppd.service"
if ! grep -q "^ExecStart=$daemon " "$scratch/megacppd.service"; then
  echo "$unit: no line ExecStart=/usr/local/bin/megacppd ... (README's install step puts it there)"
  exit 1
fi

# verify exits 0 on unknown or misspelt keys and only prints them: any output is a failure.
out=$(cd "$scratch" && systemd-analyze verify ./megacppd.service 2>&1) || {
  echo "$unit: systemd-analyze verify failed:"
  echo "$out"
  exit 1
}
if [ -n "$out" ]; then
  echo "$unit: systemd-analyze verify reported:"
  echo "$out"
  exit 1
fi

status=0
for line in User=megacpp Group=megacpp StateDirectory=megacpp NoNewPrivileges=yes \
  ProtectSystem=strict ProtectHome=yes PrivateTmp=yes Restart=on-failure DevicePolicy=closed \
  CapabilityBoundingSet= KillMode=mixed; do
  if ! grep -qx "$line" "$unit"; then
    echo "$unit: missing $line"
    status=1
  fi
done
# Anything writable beyond the state and cache directories must be deliberate.
if grep -E '^(ReadWritePaths|ProtectSystem=(no|yes|full)|ProtectHome=no|PrivateDevices=no)' "$unit"; then
  echo "$unit: widens what the daemon may write"
  status=1
fi
[ $status -eq 0 ] && echo "$unit: verified"
exit $status
