#!/usr/bin/env bash
# Debian packages the tests use for real: Prometheus + promtool, Alertmanager + amtool,
# Pushgateway, h5clear, headless Chromium (the report rendering test). Installs only what is
# missing; needs root (or passwordless sudo).
set -euo pipefail
need=()
command -v promtool >/dev/null || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null || need+=(prometheus-alertmanager)
command -v prometheus-pushgateway >/dev/null || need+=(prometheus-pushgateway)
command -v h5clear >/dev/null || need+=(hdf5-tools)
command -v chromium >/dev/null || need+=(chromium)
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
echo "system-deps: installing ${need[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
