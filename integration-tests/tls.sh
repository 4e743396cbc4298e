# TLS listeners beside the plain ones, for the tests that connect over TLS: sourced by
# services.sh (`services.sh tls`), after the plain services are up.
#
# A throwaway certificate authority, made once into $ONCELY_TLS_DIR (default
# $ONCELY_CACHE/tls) and reused until it nears expiry:
#   ca.pem             the CA every TLS listener's certificate is signed by
#   server.pem/.key    the listeners' certificate, for 127.0.0.1, ::1 and localhost
#   client.pem/.key    a client certificate (CN oncely-test-client), for the listeners
#                      that ask for one
#   other-ca.pem       a CA that signed nothing here: a client trusting only it must be
#                      refused by every listener
# and the listeners, on this machine only:
#   Redis      REDIS_TLS_URL     (default rediss://127.0.0.1:6380): a second redis-server,
#              TLS only, which asks for a client certificate (mutual TLS)
#   PostgreSQL DATABASE_TLS_URL  (default postgres://postgres@127.0.0.1:5432/test?sslmode=require):
#              the same server, its certificate switched to server.pem (`ssl = on`)
#   MariaDB    MYSQL_TLS_URL     (default mysql://root@127.0.0.1:3306/test?ssl-mode=VERIFY_IDENTITY):
#              the same server with ssl_cert and ssl_key set (a restart, once)
#   RabbitMQ   AMQP_TLS_ADDR     (default amqps://guest:guest@127.0.0.1:5671/%2f): a TLS
#              listener on the same broker, which asks for a client certificate (a
#              restart, once)

ONCELY_TLS_DIR="${ONCELY_TLS_DIR:-$ONCELY_CACHE/tls}"
REDIS_TLS_URL="${REDIS_TLS_URL:-rediss://127.0.0.1:6380}"
AMQP_TLS_ADDR="${AMQP_TLS_ADDR:-amqps://guest:guest@127.0.0.1:5671/%2f}"

# make_cert NAME CA SUBJECT [EXTENSIONS]: a key and a certificate signed by CA (ca or
# other-ca), valid for ten years.
make_cert() {
  local name=$1 ca=$2 subject=$3 extensions=${4:-}
  openssl req -new -newkey rsa:2048 -nodes -subj "$subject" \
    -keyout "$ONCELY_TLS_DIR/$name.key" -out "$ONCELY_TLS_DIR/$name.csr" 2>/dev/null
  openssl x509 -req -in "$ONCELY_TLS_DIR/$name.csr" -days 3650 -sha256 \
    -CA "$ONCELY_TLS_DIR/$ca.pem" -CAkey "$ONCELY_TLS_DIR/$ca.key" -CAcreateserial \
    ${extensions:+-extfile <(printf '%s\n' "$extensions")} \
    -out "$ONCELY_TLS_DIR/$name.pem" 2>/dev/null
  rm -f "$ONCELY_TLS_DIR/$name.csr"
}

make_ca() {
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -sha256 -subj "/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -keyout "$ONCELY_TLS_DIR/$1.key" -out "$ONCELY_TLS_DIR/$1.pem" 2>/dev/null
}

# Set when this run made the certificates anew: every listener then takes the new ones.
TLS_REMADE=""

ensure_tls_files() {
  # Made again a month before the CA or a certificate expires.
  if [[ -f $ONCELY_TLS_DIR/client.pem ]] \
    && openssl x509 -checkend 2592000 -noout -in "$ONCELY_TLS_DIR/ca.pem" >/dev/null \
    && openssl x509 -checkend 2592000 -noout -in "$ONCELY_TLS_DIR/server.pem" >/dev/null; then
    return
  fi
  command -v openssl >/dev/null || apt_install openssl
  log "tls: making a throwaway CA and certificates in $ONCELY_TLS_DIR"
  mkdir -p "$ONCELY_TLS_DIR"
  make_ca ca "oncely test CA"
  make_ca other-ca "another CA"
  # clientAuth too: Redis Cluster nodes present it to each other on the cluster bus.
  make_cert server ca "/CN=localhost" \
    "subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost
extendedKeyUsage=serverAuth,clientAuth
keyUsage=critical,digitalSignature,keyEncipherment"
  make_cert client ca "/CN=oncely-test-client" \
    "extendedKeyUsage=clientAuth
keyUsage=critical,digitalSignature,keyEncipherment"
  # PKCS#8 keys: every client library here reads them.
  for name in server client; do
    openssl pkcs8 -topk8 -nocrypt -in "$ONCELY_TLS_DIR/$name.key" -out "$ONCELY_TLS_DIR/$name.key.new"
    mv "$ONCELY_TLS_DIR/$name.key.new" "$ONCELY_TLS_DIR/$name.key"
  done
  TLS_REMADE=1
}

# server_copy USER: a directory of ca.pem, server.pem and server.key that USER owns.
server_copy() {
  local user=$1 dir="/var/lib/oncely-tls/$1"
  if [[ ! -f $dir/server.pem ]] || ! cmp -s "$dir/server.pem" "$ONCELY_TLS_DIR/server.pem"; then
    mkdir -p "$dir"
    cp "$ONCELY_TLS_DIR"/{ca.pem,server.pem,server.key} "$dir/"
    chown -R "$user" "$dir"
    chmod 700 "$dir"; chmod 600 "$dir/server.key"
  fi
  printf '%s' "$dir"
}

redis_tls_answers() {
  redis-cli --tls --cacert "$ONCELY_TLS_DIR/ca.pem" --cert "$ONCELY_TLS_DIR/client.pem" \
    --key "$ONCELY_TLS_DIR/client.key" -h "$1" -p "$2" ping 2>/dev/null | grep -q PONG
}

ensure_redis_tls() {
  local host port
  host=$(url_host "$REDIS_TLS_URL"); port=$(url_port "$REDIS_TLS_URL" 6380)
  if [[ -n $TLS_REMADE && -f /var/run/redis-oncely-tls.pid ]]; then
    kill "$(cat /var/run/redis-oncely-tls.pid)" 2>/dev/null || true
    wait_for redis-tls-stop 10 bash -c "! (exec 3<>/dev/tcp/$host/$port) 2>/dev/null"
  fi
  if redis_tls_answers "$host" "$port"; then log "tls: redis up at $host:$port"; return; fi
  is_local "$host" || die "tls: no Redis TLS listener at $host:$port, and it is not this machine"
  log "tls: starting redis-server with TLS only on 127.0.0.1:$port"
  redis-server --daemonize yes --bind 127.0.0.1 --port 0 --tls-port "$port" \
    --tls-cert-file "$ONCELY_TLS_DIR/server.pem" --tls-key-file "$ONCELY_TLS_DIR/server.key" \
    --tls-ca-cert-file "$ONCELY_TLS_DIR/ca.pem" --tls-auth-clients yes \
    --save "" --appendonly no --dir /tmp --pidfile /var/run/redis-oncely-tls.pid >/dev/null
  wait_for redis-tls 30 redis_tls_answers "$host" "$port"
  log "tls: redis up at $host:$port (client certificate required)"
}

postgres_tls_answers() {
  timeout 5 openssl s_client -starttls postgres -connect "$1:$2" -CAfile "$ONCELY_TLS_DIR/ca.pem" \
    -verify_return_error </dev/null >/dev/null 2>&1
}

ensure_postgres_tls() {
  local host port admin dir
  host=$(url_host "$DATABASE_URL"); port=$(url_port "$DATABASE_URL" 5432)
  admin="postgres://$(url_user "$DATABASE_URL" postgres)@$host:$port/postgres"
  if [[ -z $TLS_REMADE ]] && psql "$admin" -tAc "SHOW ssl_cert_file" | grep -q "/var/lib/oncely-tls/postgres/server.pem" \
    && [[ $(psql "$admin" -tAc "SHOW ssl") == on ]]; then
    server_copy postgres >/dev/null
    log "tls: postgres serves the test certificate at $host:$port"
    return
  fi
  is_local "$host" || die "tls: postgres at $host:$port does not serve the test certificate"
  dir=$(server_copy postgres)
  psql "$admin" -qc "ALTER SYSTEM SET ssl = on" \
    -c "ALTER SYSTEM SET ssl_cert_file = '$dir/server.pem'" \
    -c "ALTER SYSTEM SET ssl_key_file = '$dir/server.key'" \
    -c "ALTER SYSTEM SET ssl_ca_file = '$dir/ca.pem'" \
    -c "SELECT pg_reload_conf()" >/dev/null
  # A reload keeps the old files when the new ones are unusable: check what it serves.
  wait_for postgres-tls 10 postgres_tls_answers "$host" "$port"
  log "tls: postgres serves the test certificate at $host:$port"
}

# The MariaDB configuration file the server reads its TLS files from: a file of its own in
# an included directory, or else a block at the end of my.cnf itself (Debian's machines
# here have a my.cnf with no include directory).
mariadb_tls_conf() {
  local dir
  for dir in /etc/mysql/mariadb.conf.d /etc/mysql/conf.d; do
    if [[ -d $dir ]] && grep -qs "^!includedir $dir" /etc/mysql/my.cnf /etc/mysql/mariadb.cnf; then
      printf '%s' "$dir/90-oncely-tls.cnf"; return
    fi
  done
  printf '%s' /etc/mysql/my.cnf
}

ensure_mariadb_tls() {
  local host port user dir conf
  host=$(url_host "$MYSQL_URL"); port=$(url_port "$MYSQL_URL" 3306); user=$(url_user "$MYSQL_URL" root)
  export MYSQL_PWD; MYSQL_PWD=$(url_password "$MYSQL_URL" || true)
  local ask=(mariadb --protocol=tcp -h "$host" -P "$port" -u "$user" -N -e)
  if [[ -z $TLS_REMADE ]] && "${ask[@]}" "SELECT @@ssl_cert" | grep -q "/var/lib/oncely-tls/mysql/server.pem"; then
    server_copy mysql >/dev/null
    log "tls: mariadb serves the test certificate at $host:$port"
    return
  fi
  is_local "$host" || die "tls: mariadb at $host:$port does not serve the test certificate"
  dir=$(server_copy mysql)
  conf=$(mariadb_tls_conf)
  if ! grep -qs "^# oncely-tls" "$conf"; then
    printf '\n# oncely-tls (integration-tests/tls.sh)\n[mariadbd]\nssl_ca = %s/ca.pem\nssl_cert = %s/server.pem\nssl_key = %s/server.key\n' \
      "$dir" "$dir" "$dir" >>"$conf"
  fi
  # ssl_cert is read at startup only: a restart, once, the way ensure_mariadb starts it.
  log "tls: restarting mariadb with the test certificate ($conf)"
  mariadb-admin --protocol=tcp -h "$host" -P "$port" -u "$user" shutdown >/dev/null 2>&1 || true
  wait_for mariadb-stop 60 bash -c "! mariadb-admin --protocol=tcp -h $host -P $port ping >/dev/null 2>&1"
  if [[ -x /etc/init.d/mariadb ]]; then
    /etc/init.d/mariadb start >/dev/null 2>&1 || true
  else
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd >/dev/null
  fi
  wait_for mariadb 60 mariadb_answers "$host" "$port"
  "${ask[@]}" "SELECT @@ssl_cert" | grep -q "$dir/server.pem" \
    || die "tls: mariadb restarted without the test certificate (see $conf)"
  log "tls: mariadb serves the test certificate at $host:$port"
}

amqp_tls_answers() {
  timeout 5 openssl s_client -connect "$1:$2" -CAfile "$ONCELY_TLS_DIR/ca.pem" \
    -cert "$ONCELY_TLS_DIR/client.pem" -key "$ONCELY_TLS_DIR/client.key" \
    -verify_return_error </dev/null >/dev/null 2>&1
}

ensure_rabbitmq_tls() {
  local host port dir conf=/etc/rabbitmq/rabbitmq.conf
  host=$(url_host "$AMQP_TLS_ADDR"); port=$(url_port "$AMQP_TLS_ADDR" 5671)
  if [[ -z $TLS_REMADE ]] && amqp_tls_answers "$host" "$port"; then log "tls: rabbitmq up at $host:$port"; return; fi
  is_local "$host" || die "tls: no RabbitMQ TLS listener at $host:$port, and it is not this machine"
  dir=$(server_copy rabbitmq)
  if ! grep -q "^listeners.ssl.default" "$conf" 2>/dev/null; then
    cat >>"$conf" <<CONF
# oncely's TLS tests (integration-tests/tls.sh): a listener that asks for a client certificate.
listeners.ssl.default = 127.0.0.1:$port
ssl_options.cacertfile = $dir/ca.pem
ssl_options.certfile = $dir/server.pem
ssl_options.keyfile = $dir/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = true
CONF
  fi
  # Listeners are read at startup only: a restart, once.
  log "tls: restarting rabbitmq with a TLS listener on $host:$port"
  # `shutdown` returns once the node's VM has exited (`stop` may return before).
  rabbitmqctl shutdown >/dev/null 2>&1 || true
  rabbitmq-server -detached >/dev/null 2>&1 || true
  wait_for rabbitmq 120 amqp_answers "$(url_host "$AMQP_ADDR")" "$(url_port "$AMQP_ADDR" 5672)"
  wait_for rabbitmq-tls 60 amqp_tls_answers "$host" "$port"
  log "tls: rabbitmq up at $host:$port (client certificate required)"
}

ensure_tls() {
  ensure_tls_files
  ensure_redis_tls
  ensure_postgres_tls
  ensure_mariadb_tls
  ensure_rabbitmq_tls
}
