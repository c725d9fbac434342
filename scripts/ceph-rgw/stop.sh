#!/usr/bin/env bash
# scripts/ceph-rgw/stop.sh - tierfs's own copy of the team's reference script
# ceph-rgw/stop-ceph-rgw.sh (shared ceph-rgw kit, see its README). Copied verbatim apart
# from this header, so that a fresh clone needs nothing outside the repo. Where the
# text below says stop-ceph-rgw.sh, read scripts/ceph-rgw/stop.sh. Keep in sync with upstream.
#
# stop-ceph-rgw.sh DIR — stop the daemons that start-ceph-rgw.sh DIR started
# (exactly the PIDs listed in DIR/pids, never anything matched by name) and delete DIR.
#   default     SIGKILL at once: the cluster is throw-away (memstore), nothing to save;
#               a graceful SIGTERM takes 5-12 s (the OSD waits for the mon to mark it down)
#   GRACEFUL=1  SIGTERM in order rgw -> osd -> mon, up to 15 s each, then SIGKILL
#   KEEP_DIR=1  keep DIR (logs) for debugging
set -uo pipefail
DIR=${1:?usage: stop-ceph-rgw.sh DIR}
[ -f "$DIR/pids" ] || { echo "no $DIR/pids" >&2; exit 1; }

# true if PID still runs the program we started (PIDs can be reused) and is not a
# zombie (a zombie is dead, it only waits for its parent to reap it)
alive() {  # pid exe
  [ "$(cat /proc/"$1"/comm 2>/dev/null)" = "$2" ] || return 1
  local st; st=$(sed -n 's/^State:[[:space:]]*\([A-Z]\).*/\1/p' /proc/"$1"/status 2>/dev/null)
  [ -n "$st" ] && [ "$st" != Z ]
}
wait_gone() {  # pid exe tenths
  local i
  for ((i = 0; i < $3; i++)); do alive "$1" "$2" || return 0; sleep 0.1; done
  return 1
}

# reverse start order: rgw, osd, mon
while read -r name pid; do
  case $name in mon.*) exe=ceph-mon ;; osd.*) exe=ceph-osd ;; rgw.*) exe=radosgw ;; *) continue ;; esac
  alive "$pid" "$exe" || continue
  if [ "${GRACEFUL:-0}" = 1 ]; then
    kill -TERM "$pid" 2>/dev/null
    wait_gone "$pid" "$exe" 150 && continue
  fi
  kill -KILL "$pid" 2>/dev/null
  wait_gone "$pid" "$exe" 50 || echo "warning: $name pid $pid still alive" >&2
done < <(tac "$DIR/pids")

[ "${KEEP_DIR:-0}" = 1 ] || rm -rf "$DIR"
