#!/bin/sh
# Certificates for docker-compose.temporal.yml's Temporal with mutual TLS, made with the openssl
# CLI: a local CA, the server's certificate (for the names temporal, localhost and 127.0.0.1,
# where its clients dial it) and one client certificate per client: gpufleet (the worker, and the
# intake and the API where they run), temporal-ui (the Web UI) and temporal-admin (the setup step,
# and you with the temporal CLI). The frontend accepts only clients with a certificate of this CA.
#
#   scripts/temporal-certs.sh [DIR]          (make temporal-certs; DIR: ./secrets/temporal-tls)
#
# Whatever exists already is kept (run it again after deleting a file to remake that one; delete
# DIR to start over with a new CA). ca.key stays in DIR and is never mounted: keep DIR to yourself
# (mode 0700). The other keys are 0644 because the containers read them as their own users (the
# server as 1000, the worker as 10001): inside DIR, only this host's root and you can reach them.
set -eu
dir=${1:-./secrets/temporal-tls}
days=${TEMPORAL_CERT_DAYS:-825}
mkdir -p "$dir"
chmod 0700 "$dir"
cd "$dir"

if [ ! -s ca.key ] || [ ! -s ca.crt ]; then
    openssl req -x509 -newkey rsa:4096 -sha256 -nodes -days 3650 \
        -subj "/O=gpufleet/CN=gpufleet local Temporal CA" \
        -keyout ca.key -out ca.crt \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
    chmod 0600 ca.key
fi

# issue NAME USAGE SAN: NAME.key and NAME.crt, signed by the CA.
issue() {
    name=$1 usage=$2 san=$3
    if [ -s "$name.key" ] && [ -s "$name.crt" ]; then
        return 0
    fi
    openssl req -newkey rsa:2048 -sha256 -nodes -subj "/O=gpufleet/CN=$name" -keyout "$name.key" -out "$name.csr"
    printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
        "extendedKeyUsage=$usage" "subjectAltName=$san" > "$name.ext"
    openssl x509 -req -sha256 -days "$days" -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial \
        -extfile "$name.ext" -out "$name.crt"
    rm -f "$name.csr" "$name.ext"
    chmod 0644 "$name.key" "$name.crt"
}

# The server presents it to clients and, between its own services, uses it as a client too.
issue server serverAuth,clientAuth "DNS:temporal,DNS:localhost,IP:127.0.0.1"
issue gpufleet clientAuth "DNS:gpufleet"
issue temporal-ui clientAuth "DNS:temporal-ui"
issue temporal-admin clientAuth "DNS:temporal-admin"
openssl verify -CAfile ca.crt server.crt gpufleet.crt temporal-ui.crt temporal-admin.crt
