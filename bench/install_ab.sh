#!/bin/sh
# `make install` into fresh venvs with uv against pip (issue 53), rounds interleaved: cold caches
# (an empty pip and uv cache each) A B B A, then warm caches (the caches the cold rounds filled)
# A B B A. Per run: wall seconds, CPU seconds (user + sys, make and all it ran), the machine's load
# average, packages installed. Nothing here touches .venv.
# Usage: sh bench/install_ab.sh [workdir]   (default /tmp/tokenmill-install-ab; ~20 min on 2 idle cores)
# PLAN="installer:cache:state ..." runs other rounds, e.g. PLAN="uv:1:warm pip:1:warm" in a workdir kept
# from a run (KEEP=1: do not empty it first).
set -eu
work=${1:-/tmp/tokenmill-install-ab}
[ "${KEEP:-0}" = 1 ] || rm -rf "$work"
mkdir -p "$work"
PLAN=${PLAN:-"pip:1:cold uv:1:cold uv:2:cold pip:2:cold pip:1:warm uv:1:warm uv:2:warm pip:2:warm"}
echo "# $(date -u +%FT%TZ) $(git rev-parse --short HEAD) $(nproc) cores"
for item in $PLAN; do
    installer=${item%%:*}; rest=${item#*:}; cache=${rest%%:*}; state=${rest#*:}
    label="$state-$installer-$cache"; venv="$work/venv-$label"
    PIP_CACHE_DIR="$work/cache-$installer-$cache/pip" UV_CACHE_DIR="$work/cache-$installer-$cache/uv" \
        /usr/bin/time -f "%e %U %S" -o "$work/$label.time" \
        make --no-print-directory install VENV="$venv" INSTALLER="$installer" >"$work/$label.log" 2>&1 \
        || { echo "$label failed: $work/$label.log"; exit 1; }
    read -r wall user sys <"$work/$label.time"
    printf '%-14s wall %6.1f s  cpu %6.1f s  load %s  (%s packages, %s lines printed)\n' "$label" "$wall" \
        "$(echo "$user + $sys" | bc)" "$(cut -d' ' -f1-3 /proc/loadavg)" \
        "$("$venv/bin/python" -m pip list 2>/dev/null | tail -n +3 | wc -l)" "$(wc -l <"$work/$label.log")"
    rm -rf "$venv"
done
