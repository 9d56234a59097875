#!/usr/bin/env bash
# Copy this machine's redis-server and the shared libraries it needs (glibc and the C++ runtime
# excepted: the device machine has its own, newer ones) into .device/redis, with a wrapper that
# runs it against them. run_bench_host.sh puts .device/redis first on PATH.
set -euo pipefail
cd "$(dirname "$0")/../.."
d=.device/redis
rm -rf "$d" && mkdir -p "$d/lib"
bin=$(command -v redis-server)
cp "$bin" "$d/redis-server.bin"
ldd "$bin" | awk '$3 ~ /^\// {print $3}' \
  | grep -Ev '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so' \
  | while read -r lib; do cp -L "$lib" "$d/lib/"; done
cat >"$d/redis-server" <<'SH'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/lib" exec "$here/redis-server.bin" "$@"
SH
chmod +x "$d/redis-server"
du -sh "$d"
