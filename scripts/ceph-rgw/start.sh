#!/usr/bin/env bash
# scripts/ceph-rgw/start.sh - tierfs's own copy of the team's reference script
# ceph-rgw/start-ceph-rgw.sh (shared ceph-rgw kit, see its README). Copied verbatim apart
# from this header, so that a fresh clone needs nothing outside the repo. Where the
# text below says start-ceph-rgw.sh, read scripts/ceph-rgw/start.sh. Keep in sync with upstream.
#
# start-ceph-rgw.sh — throw-away single-node Ceph (1 mon, 1 memstore OSD, no mgr)
# + radosgw (S3 API) on 127.0.0.1 only, all state under one folder, no systemd.
# Tested: Debian 12, ceph 16.2.15 (Pacific) from bookworm; ~1 s (0.7-1.7 s) to S3-ready.
#
# Needs:   apt-get install -y --no-install-recommends ceph-mon ceph-osd ceph-common radosgw
#          (+ curl; openssl only for RGW_HTTPS=1)
# Usage:   start-ceph-rgw.sh [DIR]   DIR must be absent or empty
#                                    (default: mktemp -d /tmp/ceph-rgw.XXXXXX); no spaces
# Env:     RGW_PORT, MON_PORT      default: random free ports in 10000-32000 (the OSD
#                                  takes 4 ports in 6800-7300 by itself)
#          S3_ACCESS_KEY, S3_SECRET_KEY   default: the fixed test keys below
#          MEMSTORE_BYTES          OSD capacity; data lives in the OSD's RAM (only what is
#                                  stored uses RAM). When ~full, S3 requests HANG. Default 8 GiB
#          RGW_HTTPS=1             serve https with a self-signed cert ($DIR/rgw/cert.pem)
#          CEPH_START_TIMEOUT      seconds, default 60
# Output:  DIR/env   sourceable: S3_ENDPOINT S3_ACCESS_KEY S3_SECRET_KEY S3_REGION
#                    [S3_CA_BUNDLE] CEPH_CONF CEPH_RGW_DIR — also printed on stdout
#          DIR/pids  "name pid" per daemon, read by stop-ceph-rgw.sh
#          DIR/log/  daemon logs (client.rgw.gw.log has the HTTP access log)
# Stop:    stop-ceph-rgw.sh DIR    kills exactly the PIDs in DIR/pids, removes DIR
# On failure the daemons already started are killed and DIR is kept for its logs.
set -euo pipefail

T0=$(date +%s%N)
log() { printf '[%6.2fs] %s\n' "$(( $(date +%s%N) - T0 ))e-9" "$*" >&2; }

for b in ceph-mon ceph-osd ceph-authtool monmaptool ceph radosgw radosgw-admin curl; do
  command -v "$b" >/dev/null || {
    echo "missing $b: apt-get install -y --no-install-recommends ceph-mon ceph-osd ceph-common radosgw curl" >&2
    exit 2; }
done

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
free_port() {  # random port below the ephemeral range that nobody listens on
  local p
  while p=$(shuf -i 10000-32000 -n 1); port_in_use "$p"; do :; done
  echo "$p"
}
MON_PORT=${MON_PORT:-$(free_port)}
RGW_PORT=${RGW_PORT:-$(free_port)}
while [ "$RGW_PORT" = "$MON_PORT" ]; do RGW_PORT=$(free_port); done
for p in "$MON_PORT" "$RGW_PORT"; do
  ! port_in_use "$p" || { echo "port $p on 127.0.0.1 is already in use" >&2; exit 2; }
done
S3_ACCESS_KEY=${S3_ACCESS_KEY:-TESTACCESSKEY0000001}
S3_SECRET_KEY=${S3_SECRET_KEY:-testsecretkey0000000000000000000000000001}
MEMSTORE_BYTES=${MEMSTORE_BYTES:-$((8 << 30))}
TIMEOUT=${CEPH_START_TIMEOUT:-60}
DIR=${1:-$(mktemp -d /tmp/ceph-rgw.XXXXXX)}
mkdir -p "$DIR"
[ -z "$(ls -A "$DIR")" ] || { echo "$DIR is not empty" >&2; exit 2; }
DIR=$(cd "$DIR" && pwd)
case $DIR in *[[:space:]]*) echo "DIR must not contain spaces" >&2; exit 2 ;; esac

FSID=$(cat /proc/sys/kernel/random/uuid)
OSD_UUID=$(cat /proc/sys/kernel/random/uuid)
CONF=$DIR/ceph.conf
export CEPH_CONF=$CONF       # read by ceph, rados, radosgw-admin and the daemons

mkdir -p "$DIR"/{mon,osd/ceph-0,run,log,crash,rgw,tmp}
: > "$DIR/pids"

on_fail() {  # kill what we started, keep DIR for the logs
  local rc=$?
  [ "$rc" = 0 ] && return
  echo "start-ceph-rgw.sh failed (rc=$rc); logs in $DIR/log" >&2
  while read -r _ p; do kill -KILL "$p" 2>/dev/null || true; done < "$DIR/pids"
}
trap on_fail EXIT

if [ "${RGW_HTTPS:-0}" = 1 ]; then
  openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj /CN=127.0.0.1 \
    -addext "subjectAltName=IP:127.0.0.1,DNS:localhost" \
    -keyout "$DIR/rgw/key.pem" -out "$DIR/rgw/cert.pem" 2>/dev/null
  FRONTEND="beast ssl_endpoint=127.0.0.1:$RGW_PORT ssl_certificate=$DIR/rgw/cert.pem ssl_private_key=$DIR/rgw/key.pem tcp_nodelay=1"
  S3_ENDPOINT=https://127.0.0.1:$RGW_PORT
  CURL_CA=(--cacert "$DIR/rgw/cert.pem")
else
  # NB: "port=N" binds 0.0.0.0 and [::]; "port=N endpoint=127.0.0.1:N" fails with
  # EADDRINUSE. endpoint= alone listens on loopback only.
  FRONTEND="beast endpoint=127.0.0.1:$RGW_PORT tcp_nodelay=1"
  S3_ENDPOINT=http://127.0.0.1:$RGW_PORT
  CURL_CA=()
fi

cat > "$CONF" <<EOF
[global]
fsid = $FSID
mon host = [v2:127.0.0.1:$MON_PORT]
mon initial members = a
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind msgr1 = false
ms bind ipv6 = false
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
auth allow insecure global id reclaim = false
keyring = $DIR/keyring
run dir = $DIR/run
admin socket = $DIR/run/\$name.asok
pid file = $DIR/run/\$name.pid
log file = $DIR/log/\$name.log
mon cluster log file = $DIR/log/cluster.log
crash dir = $DIR/crash
tmp dir = $DIR/tmp
log to stderr = false
err to stderr = false
# one OSD: 1 replica, few PGs (default 32/pool x 7 rgw pools would exceed
# mon_max_pg_per_osd=250), no autoscaler (there is no mgr)
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon max pg per osd = 1000
mon warn on pool no redundancy = false
# do not refuse to start on a nearly full CI disk (default: crit below 5 % free)
mon data avail warn = 2
mon data avail crit = 1
# start-up speed: the mon batches map changes for paxos_propose_interval (1 s);
# every OSD-boot / pool-create step waits for it -> 14 s start instead of <1 s
paxos propose interval = 0.01
paxos min wait = 0.01

[mon]
mon data = $DIR/mon/ceph-\$id

[osd]
osd data = $DIR/osd/ceph-\$id
osd objectstore = memstore
memstore device bytes = $MEMSTORE_BYTES

[client.rgw.gw]
# tcp_nodelay=1: without it every small GET takes ~40 ms (Nagle + delayed ACK)
rgw frontends = $FRONTEND
rgw data = $DIR/rgw
# free the RAM of deleted/overwritten object tails after ~1 min, not 2 h
rgw gc obj min wait = 60
rgw gc processor period = 60
EOF

# --- keys for mon., client.admin, osd.0, client.rgw.gw in ONE keyring: ceph-mon --mkfs
#     imports them all (with caps), so no "ceph auth add" round trips are needed.
K=$DIR/keyring
ceph-authtool --create-keyring "$K" --gen-key -n mon. --cap mon 'allow *' >/dev/null
ceph-authtool "$K" --gen-key -n client.admin --cap mon 'allow *' --cap osd 'allow *' \
  --cap mgr 'allow *' --cap mds 'allow *' >/dev/null
ceph-authtool "$K" --gen-key -n osd.0 --cap mon 'allow profile osd' \
  --cap mgr 'allow profile osd' --cap osd 'allow *' >/dev/null
ceph-authtool "$K" --gen-key -n client.rgw.gw --cap mon 'allow rw' --cap osd 'allow rwx' \
  --cap mgr 'allow rw' >/dev/null

start_daemon() {  # name cmd... — run in the foreground (-f), backgrounded here, so $!
                  # is the daemon itself; no tty/pipe of the caller is inherited
  local name=$1; shift
  "$@" -f </dev/null >>"$DIR/log/$name.out" 2>&1 &
  echo "$name $!" >> "$DIR/pids"
}

# --- monitor
monmaptool --create --fsid "$FSID" --addv a "[v2:127.0.0.1:$MON_PORT]" "$DIR/monmap" >/dev/null
ceph-mon --mkfs -i a --monmap "$DIR/monmap" --keyring "$K" >>"$DIR/log/mon.a.out" 2>&1
start_daemon mon.a ceph-mon -i a
log "mon started"

# --- OSD: allocate id 0 in the osdmap (this first client call also waits for the mon)
timeout "$TIMEOUT" ceph --connect-timeout "$TIMEOUT" osd new "$OSD_UUID" 0 >/dev/null
ceph-osd -i 0 --mkfs --osd-uuid "$OSD_UUID" >>"$DIR/log/osd.0.out" 2>&1
start_daemon osd.0 ceph-osd -i 0
# wait until the OSD is up BEFORE anything creates pools: pools created while no OSD is
# up get their PGs only at the mon's next tick (mon_tick_interval = 5 s) -> 5 s stall
deadline=$(( $(date +%s) + TIMEOUT ))
until grep -q 'state: booting -> active' "$DIR/log/osd.0.log" 2>/dev/null; do
  kill -0 "$(awk '$1 == "osd.0" {print $2}' "$DIR/pids")" 2>/dev/null || { echo "osd.0 died" >&2; exit 1; }
  [ "$(date +%s)" -lt "$deadline" ] || { echo "osd.0 not up after ${TIMEOUT}s" >&2; exit 1; }
  sleep 0.02
done
log "osd up"

# --- S3 user with fixed keys, BEFORE radosgw starts: radosgw-admin creates the default
#     zone/zonegroup and the rgw pools, so radosgw then finds them and does not race it.
timeout "$TIMEOUT" radosgw-admin user create --uid=test --display-name=test \
  --access-key="$S3_ACCESS_KEY" --secret-key="$S3_SECRET_KEY" >"$DIR/log/user-create.json"
log "S3 user created"

# --- radosgw
start_daemon rgw.gw radosgw -n client.rgw.gw
deadline=$(( $(date +%s) + TIMEOUT ))
# ready = our radosgw has bound its port (it logs "starting handler" after the bind)
#         and answers HTTP
until grep -q 'starting handler: beast' "$DIR/log/client.rgw.gw.log" 2>/dev/null &&
      curl -s "${CURL_CA[@]}" -o /dev/null "$S3_ENDPOINT/"; do
  while read -r n p; do
    kill -0 "$p" 2>/dev/null || { echo "$n (pid $p) died" >&2; exit 1; }
  done < "$DIR/pids"
  [ "$(date +%s)" -lt "$deadline" ] || { echo "radosgw not ready after ${TIMEOUT}s" >&2; exit 1; }
  sleep 0.05
done
log "S3 ready on $S3_ENDPOINT"

{
  echo "export S3_ENDPOINT=$S3_ENDPOINT"
  echo "export S3_ACCESS_KEY=$S3_ACCESS_KEY"
  echo "export S3_SECRET_KEY=$S3_SECRET_KEY"
  echo "export S3_REGION=us-east-1"
  [ "${RGW_HTTPS:-0}" = 1 ] && echo "export S3_CA_BUNDLE=$DIR/rgw/cert.pem"
  echo "export CEPH_CONF=$CONF"
  echo "export CEPH_RGW_DIR=$DIR"
} > "$DIR/env"
cat "$DIR/env"
