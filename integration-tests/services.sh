#!/usr/bin/env bash
# Makes sure the services oncely's integration tests need are up on this machine.
#
# For each service: if it answers at its configured address, nothing is done; if the address
# is on this machine and the server is installed but stopped, it is started; if it is not
# installed, its Debian package is installed first. An address on another machine is only
# checked: this script never starts or installs anything there.
#
# Usage: integration-tests/services.sh [SERVICE...]
#        integration-tests/services.sh rabbitmqctl4 ARGS...   (rabbitmqctl for RabbitMQ 4.0)
#   services: redis postgres mariadb rabbitmq rabbitmq4 rocketmq tls; default: all seven
#   (tls: a throwaway CA and TLS listeners beside the plain ones, see tls.sh). RocketMQ's first
#   install builds its servers from source (about 25 min on 2 cores); later runs reuse the
#   build. RabbitMQ 4.0's first install makes a Debian 13 root (about 2 min, see below).
# Addresses come from the same variables the tests read:
#   REDIS_URL     (default redis://127.0.0.1:6379)
#   DATABASE_URL  (default postgres://postgres@127.0.0.1:5432/test)
#   MYSQL_URL     (default mysql://root@127.0.0.1:3306/test): MariaDB or MySQL
#   AMQP_ADDR     (default amqp://guest:guest@127.0.0.1:5672/%2f)
#   AMQP_ADDR_4   (default amqp://guest:guest@127.0.0.1:5673/%2f): RabbitMQ 4.x
#   ROCKETMQ_NAMESRV (default 127.0.0.1:9876)
# RocketMQ's Rust name server and broker are built once into ONCELY_CACHE (default
# ~/.cache/oncely), outside any clone, and reused; an interrupted build resumes from its
# build directory there.
set -euo pipefail

REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379}"
DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
MYSQL_URL="${MYSQL_URL:-mysql://root@127.0.0.1:3306/test}"
AMQP_ADDR="${AMQP_ADDR:-amqp://guest:guest@127.0.0.1:5672/%2f}"
AMQP_ADDR_4="${AMQP_ADDR_4:-amqp://guest:guest@127.0.0.1:5673/%2f}"
ROCKETMQ_NAMESRV="${ROCKETMQ_NAMESRV:-127.0.0.1:9876}"
ONCELY_CACHE="${ONCELY_CACHE:-$HOME/.cache/oncely}"
ROCKETMQ_VERSION=1.0.0

log() { printf 'services: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

# host and port of a URL like scheme://user:pass@host:port/path
url_host() { local rest="${1#*://}"; rest="${rest##*@}"; rest="${rest%%/*}"; printf '%s' "${rest%:*}"; }
url_user() { local rest="${1#*://}"; [[ $rest == *@* ]] && { rest="${rest%%@*}"; printf '%s' "${rest%%:*}"; } || printf '%s' "$2"; }
url_password() { local rest="${1#*://}"; [[ $rest == *@* ]] || return 0; rest="${rest%%@*}"; [[ $rest == *:* ]] && printf '%s' "${rest#*:}"; }
url_path() { local rest="${1#*://}"; [[ $rest == */* ]] || return 0; rest="${rest#*/}"; printf '%s' "${rest%%\?*}"; }
url_port() { local rest="${1#*://}"; rest="${rest##*@}"; rest="${rest%%/*}"; [[ $rest == *:* ]] && printf '%s' "${rest##*:}" || printf '%s' "$2"; }

is_local() { [[ $1 == 127.* || $1 == localhost || $1 == ::1 || $1 == '[::1]' ]]; }

apt_updated=""
apt_install() {
  command -v apt-get >/dev/null || die "cannot install $*: no apt-get on this machine"
  local sudo=""
  [[ $(id -u) == 0 ]] || sudo="sudo"
  if [[ -z $apt_updated ]]; then
    log "apt-get update"
    $sudo apt-get update -qq >/dev/null
    apt_updated=1
  fi
  log "installing $*"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# wait_for NAME SECONDS CHECK...: polls CHECK until it succeeds or SECONDS pass.
wait_for() {
  local name=$1 seconds=$2; shift 2
  local deadline=$((SECONDS + seconds))
  until "$@"; do
    ((SECONDS < deadline)) || die "$name did not come up within ${seconds}s"
    sleep 0.5
  done
}

tcp_open() { { exec 3<>"/dev/tcp/$1/$2"; } 2>/dev/null || return 1; exec 3>&- 3<&-; }

redis_answers() {
  # A PING over bash's /dev/tcp: works before redis-cli is installed.
  local host=$1 port=$2 reply=""
  { exec 3<>"/dev/tcp/$host/$port"; } 2>/dev/null || return 1
  printf 'PING\r\n' >&3
  read -r -t 2 reply <&3 || true
  exec 3>&- 3<&-
  [[ $reply == +PONG* ]]
}

ensure_redis() {
  local host port
  host=$(url_host "$REDIS_URL"); port=$(url_port "$REDIS_URL" 6379)
  if redis_answers "$host" "$port"; then log "redis: up at $host:$port"; return; fi
  is_local "$host" || die "redis: nothing answers at $host:$port, and it is not this machine"
  command -v redis-server >/dev/null || apt_install redis-server redis-tools
  # The package may have started a server of its own.
  if ! redis_answers "$host" "$port"; then
    log "redis: starting on 127.0.0.1:$port"
    redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --save "" --appendonly no >/dev/null
  fi
  wait_for redis 30 redis_answers "$host" "$port"
  log "redis: up at $host:$port"
}

postgres_answers() {
  if command -v pg_isready >/dev/null; then pg_isready -q -h "$1" -p "$2"; else tcp_open "$1" "$2"; fi
}

ensure_postgres() {
  local host port user database version installed=""
  host=$(url_host "$DATABASE_URL"); port=$(url_port "$DATABASE_URL" 5432)
  user=$(url_user "$DATABASE_URL" postgres); database=$(url_path "$DATABASE_URL")
  if ! postgres_answers "$host" "$port"; then
    is_local "$host" || die "postgres: nothing answers at $host:$port, and it is not this machine"
    if ! compgen -G '/etc/postgresql/*/main' >/dev/null; then
      apt_install postgresql postgresql-client
      installed=1
    fi
    version=$(ls /etc/postgresql | sort -V | tail -n 1)
    if [[ -n $installed ]]; then
      # Trust loopback connections, as the project's machines do; only on a server this
      # script installed itself.
      sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "/etc/postgresql/$version/main/pg_hba.conf"
    fi
    log "postgres: starting cluster $version/main"
    pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
    wait_for postgres 60 postgres_answers "$host" "$port"
  fi
  command -v psql >/dev/null || apt_install postgresql-client
  local admin="postgres://$user@$host:$port/postgres"
  if [[ -n $database ]] && ! psql "$admin" -tAc "SELECT 1 FROM pg_database WHERE datname = '$database'" | grep -q 1; then
    log "postgres: creating database $database"
    psql "$admin" -qc "CREATE DATABASE \"$database\"" >/dev/null
  fi
  log "postgres: up at $host:$port, database ${database:-postgres}"
}

mariadb_answers() {
  # mysqladmin ping succeeds whenever the server runs, even if it refuses the user.
  if command -v mysqladmin >/dev/null; then
    mysqladmin --protocol=tcp -h "$1" -P "$2" ping >/dev/null 2>&1
  else
    tcp_open "$1" "$2"
  fi
}

ensure_mariadb() {
  local host port user database installed=""
  host=$(url_host "$MYSQL_URL"); port=$(url_port "$MYSQL_URL" 3306)
  user=$(url_user "$MYSQL_URL" root); database=$(url_path "$MYSQL_URL")
  if ! mariadb_answers "$host" "$port"; then
    is_local "$host" || die "mariadb: nothing answers at $host:$port, and it is not this machine"
    if ! command -v mariadbd >/dev/null && ! command -v mysqld >/dev/null \
      && [[ ! -x /usr/sbin/mariadbd && ! -x /usr/sbin/mysqld ]]; then
      apt_install mariadb-server mariadb-client
      installed=1
    fi
    log "mariadb: starting"
    local sudo=""
    [[ $(id -u) == 0 ]] || sudo="sudo"
    if [[ -x /etc/init.d/mariadb ]]; then
      $sudo /etc/init.d/mariadb start >/dev/null 2>&1 || true
    elif [[ -x /etc/init.d/mysql ]]; then
      $sudo /etc/init.d/mysql start >/dev/null 2>&1 || true
    else
      $sudo setsid mysqld_safe >/dev/null 2>&1 </dev/null &
    fi
    wait_for mariadb 60 mariadb_answers "$host" "$port"
    if [[ -n $installed ]]; then
      # Debian's root signs in by its Unix socket only; let it in over loopback TCP with
      # an empty password too, as the project's machines do — only on a server this
      # script installed itself.
      $sudo mariadb -e "ALTER USER 'root'@'localhost' IDENTIFIED VIA unix_socket OR mysql_native_password USING PASSWORD('')"
    fi
  fi
  command -v mariadb >/dev/null || apt_install mariadb-client
  if [[ -n $database ]]; then
    MYSQL_PWD=$(url_password "$MYSQL_URL") \
      mariadb --protocol=tcp -h "$host" -P "$port" -u "$user" -e "CREATE DATABASE IF NOT EXISTS \`$database\`" \
      || die "mariadb: cannot sign in as $user at $host:$port (MYSQL_URL)"
  fi
  log "mariadb: up at $host:$port, database ${database:-none}"
}

amqp_answers() {
  # The AMQP handshake starts with the client's protocol header; a broker that is up answers
  # with its own connection.start, which begins with frame type 1.
  local host=$1 port=$2 reply=""
  { exec 3<>"/dev/tcp/$host/$port"; } 2>/dev/null || return 1
  printf 'AMQP\x00\x00\x09\x01' >&3
  reply=$(timeout 2 head -c 1 <&3 | od -An -tu1 | tr -d ' ') || true
  exec 3>&- 3<&-
  [[ $reply == 1 ]]
}

ensure_rabbitmq() {
  local host port
  host=$(url_host "$AMQP_ADDR"); port=$(url_port "$AMQP_ADDR" 5672)
  if amqp_answers "$host" "$port"; then log "rabbitmq: up at $host:$port"; return; fi
  is_local "$host" || die "rabbitmq: nothing answers at $host:$port, and it is not this machine"
  command -v rabbitmq-server >/dev/null || apt_install rabbitmq-server
  if ! amqp_answers "$host" "$port"; then
    log "rabbitmq: starting"
    rabbitmq-server -detached >/dev/null 2>&1 || true
  fi
  wait_for rabbitmq 120 amqp_answers "$host" "$port"
  log "rabbitmq: up at $host:$port"
}

# RabbitMQ 4.0, the version users install today (Debian 13's). Its Erlang 27 needs a newer C
# library than Debian 12's, so it runs in a Debian 13 root made with debootstrap from the
# host's own apt mirror, sharing the host's network (and epmd) on ports of its own: AMQP on
# AMQP_ADDR_4's port, Erlang distribution on 20000 + that port. The root lives in
# ONCELY_CACHE and is reused; the node's data lives in the root's /var/lib/rabbitmq4.
ensure_rabbitmq4() {
  local host port root="$ONCELY_CACHE/debian13"
  host=$(url_host "$AMQP_ADDR_4"); port=$(url_port "$AMQP_ADDR_4" 5673)
  if amqp_answers "$host" "$port"; then log "rabbitmq4: up at $host:$port"; return; fi
  is_local "$host" || die "rabbitmq4: nothing answers at $host:$port, and it is not this machine"
  if [[ ! -x $root/usr/sbin/rabbitmq-server ]]; then
    command -v debootstrap >/dev/null || apt_install debootstrap
    local mirror
    mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    mirror=${mirror:-http://deb.debian.org/debian}
    log "rabbitmq4: making a Debian 13 root in $root (once; about 2 min)"
    rm -rf "$root.partial"
    debootstrap --variant=minbase trixie "$root.partial" "$mirror" >/dev/null
    # No service starts inside the root on its own: the node below is started by hand.
    printf '#!/bin/sh\nexit 101\n' >"$root.partial/usr/sbin/policy-rc.d"
    chmod +x "$root.partial/usr/sbin/policy-rc.d"
    # apt in the root complains that it has no terminal for its log; only a failure matters.
    chroot "$root.partial" bash -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends rabbitmq-server' >"$root.install.log" 2>&1 ||
      { cat "$root.install.log" >&2; die "rabbitmq4: installing rabbitmq-server in $root.partial failed"; }
    mv "$root.partial" "$root"
  fi
  mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
  mkdir -p "$root/var/lib/rabbitmq4"
  chroot "$root" chown rabbitmq:rabbitmq /var/lib/rabbitmq4
  log "rabbitmq4: starting on 127.0.0.1:$port"
  chroot "$root" su rabbitmq -s /bin/sh -c "cd /var/lib/rabbitmq4 && HOME=/var/lib/rabbitmq4 \
    RABBITMQ_NODENAME=rabbit4@localhost RABBITMQ_NODE_PORT=$port RABBITMQ_DIST_PORT=$((20000 + port)) \
    RABBITMQ_MNESIA_BASE=/var/lib/rabbitmq4/mnesia RABBITMQ_LOG_BASE=/var/lib/rabbitmq4/log \
    rabbitmq-server -detached" >/dev/null 2>&1 || true
  wait_for rabbitmq4 120 amqp_answers "$host" "$port"
  log "rabbitmq4: up at $host:$port (RabbitMQ $(ls "$root"/usr/lib/rabbitmq/lib | sed -n 's/^rabbitmq_server-//p'))"
}

# rabbitmqctl for the RabbitMQ 4.0 node started above, run inside its root as the node's user
# (whose home holds the Erlang cookie): `services.sh rabbitmqctl4 ARGS...`.
rabbitmqctl4() {
  local root="$ONCELY_CACHE/debian13"
  # Debian's rabbitmqctl runs as the rabbitmq user with that user's home, whose cookie is not
  # the node's (the node's home is /var/lib/rabbitmq4): the node's cookie is passed instead.
  chroot "$root" rabbitmqctl -q -n rabbit4@localhost \
    --erlang-cookie "$(cat "$root/var/lib/rabbitmq4/.erlang.cookie")" "$@"
}

# True while process $1 runs; an exited child of this script stays a zombie until reaped,
# which `kill -0` would still report as alive.
running() { local state; state=$(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null) && [[ $state != Z ]]; }

# True once the broker listens, or once its process $1 has exited.
broker_started() { tcp_open 127.0.0.1 10911 || ! running "$1"; }

ensure_rocketmq() {
  local host=${ROCKETMQ_NAMESRV%:*} port=${ROCKETMQ_NAMESRV##*:}
  if tcp_open "$host" "$port" && tcp_open "$host" 10911; then log "rocketmq: up at $host:$port"; return; fi
  is_local "$host" || die "rocketmq: nothing answers at $host:$port, and it is not this machine"
  local root="$ONCELY_CACHE/rocketmq-$ROCKETMQ_VERSION" run="${TMPDIR:-/tmp}/oncely-rocketmq"
  if [[ ! -x $root/bin/rocketmq-broker-rust || ! -x $root/bin/rocketmq-namesrv-rust ]]; then
    log "rocketmq: building the name server and broker $ROCKETMQ_VERSION into $root (once; ~25 min)"
    # The build directory is kept until both binaries are installed, so that a run cut off
    # mid-build (a CI time limit) resumes where it stopped instead of starting over.
    cargo install --locked --quiet --root "$root" --target-dir "$ONCELY_CACHE/rocketmq-build" \
      "rocketmq-namesrv@$ROCKETMQ_VERSION" "rocketmq-broker@$ROCKETMQ_VERSION"
    rm -rf "$ONCELY_CACHE/rocketmq-build"
  fi
  mkdir -p "$run/conf" "$run/store"
  if ! tcp_open "$host" "$port"; then
    log "rocketmq: starting the name server on $host:$port"
    setsid "$root/bin/rocketmq-namesrv-rust" --bindAddress 127.0.0.1 --rocketmqHome "$run" \
      >"$run/namesrv.log" 2>&1 </dev/null &
    wait_for rocketmq-namesrv 60 tcp_open "$host" "$port"
  fi
  if ! tcp_open 127.0.0.1 10911; then
    cat >"$run/conf/broker.toml" <<TOML
[broker]
namesrvAddr = "$host:$port"
brokerIp1 = "127.0.0.1"
listenPort = 10911
storePathRootDir = "$run/store"

[broker.brokerServerConfig]
bindAddress = "127.0.0.1"

[broker.brokerIdentity]
brokerName = "oncely-broker"
brokerClusterName = "DefaultCluster"
brokerId = 0

[store]
storeType = "LocalFile"
brokerRole = "ASYNC_MASTER"
storePathRootDir = "$run/store"
haListenAddress = "127.0.0.1"
haListenPort = 10912
TOML
    # A broker started right after another one stopped can fail its startup while the old
    # one's ports are still being released; it exits, and a second start succeeds.
    local try pid
    for try in 1 2 3; do
      log "rocketmq: starting the broker on 127.0.0.1:10911"
      ROCKETMQ_HOME="$run" ROCKETMQ_SECURITY_PROFILE=development-insecure-loopback \
        setsid "$root/bin/rocketmq-broker-rust" -c "$run/conf/broker.toml" -n "$host:$port" \
        >"$run/broker.log" 2>&1 </dev/null &
      pid=$!
      wait_for rocketmq-broker 60 broker_started "$pid"
      tcp_open 127.0.0.1 10911 && break
      log "rocketmq: the broker exited during startup (try $try); see $run/broker.log"
      # Its store refuses to start on a disk fuller than its limit (seen at 74 % used).
      if grep -aq "disk capacity requires reclaim" "$run/broker.log"; then
        die "rocketmq: the broker refuses to start: its disk is over the store's usage limit ($(df -h --output=pcent "$run" | tail -n 1 | tr -d ' ') used); free space (a cargo target directory, old clones' builds) and run again"
      fi
      ((try < 3)) || die "rocketmq: the broker did not start"
      sleep 3
    done
  fi
  log "rocketmq: up at $host:$port (broker 127.0.0.1:10911; logs and store in $run)"
}

# shellcheck source=integration-tests/tls.sh
source "$(dirname "${BASH_SOURCE[0]}")/tls.sh"

if [[ ${1:-} == rabbitmqctl4 ]]; then shift; rabbitmqctl4 "$@"; exit; fi
services=("$@")
[[ ${#services[@]} -gt 0 ]] || services=(redis postgres mariadb rabbitmq rabbitmq4 rocketmq tls)
for service in "${services[@]}"; do
  case $service in
    redis) ensure_redis ;;
    postgres) ensure_postgres ;;
    mariadb) ensure_mariadb ;;
    rabbitmq) ensure_rabbitmq ;;
    rabbitmq4) ensure_rabbitmq4 ;;
    rocketmq) ensure_rocketmq ;;
    tls) ensure_tls ;;
    *) die "unknown service $service" ;;
  esac
done
