#!/bin/bash
# The container image's health check: exits 0 when quotad's /readyz answers 200, 1 otherwise
# (not listening, starting, or draining on SIGTERM). Bash alone, so the image needs no HTTP
# client. The address is QUOTAD_API_LISTEN's (the image sets 0.0.0.0:7450), reached on
# loopback when it names every interface.
set -u
listen=${QUOTAD_API_LISTEN:-127.0.0.1:7450}
port=${listen##*:}
host=${listen%:*}
host=${host#[}
host=${host%]}
case $host in
    0.0.0.0 | "") host=127.0.0.1 ;;
    ::) host=::1 ;;
esac
exec 3<>"/dev/tcp/$host/$port" || exit 1
printf 'GET /readyz HTTP/1.0\r\nHost: quotad\r\n\r\n' >&3 || exit 1
IFS= read -r -t "${QUOTAD_READY_TIMEOUT_S:-2}" status <&3 || exit 1
case $status in
    "HTTP/1."?" 200 "*) exit 0 ;;
    *) exit 1 ;;
esac
