# syntax=docker/dockerfile:1
# quotad's container image: built from source in a Rust image, run from a small Debian one.
#
#   docker build -t quotad .
#   docker run --rm -p 7450:7450 -e QUOTAD_ADMIN_TOKEN=... quotad
#
# Without a config of its own the image runs one region on the embedded store. Mount a config
# at /etc/quotad/quotad.toml and the data dir at /var/lib/quotad (docs/deployment.md).

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

FROM rust:${RUST_VERSION}-slim-${DEBIAN_RELEASE} AS build
WORKDIR /src
COPY . .
# The cache mounts keep the registry and the build between image builds; the binary is copied
# out of the cached target dir, which does not survive into the layer.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p quotad \
    && install -m 0755 target/release/quotad /usr/local/bin/quotad

FROM debian:${DEBIAN_RELEASE}-slim
# ca-certificates: the system roots a rediss:// Redis is verified against unless redis.tls_ca_file
# names others. Left unpinned so the trust store follows the distribution's updates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 quotad \
    && useradd --system --uid 10001 --gid quotad --home-dir /var/lib/quotad --shell /usr/sbin/nologin quotad \
    && install -d -o quotad -g quotad -m 0750 /var/lib/quotad \
    && install -d -m 0755 /etc/quotad
COPY --from=build /usr/local/bin/quotad /usr/local/bin/quotad
COPY scripts/quotad-ready.sh /usr/local/bin/quotad-ready
COPY config/single-region.toml /etc/quotad/quotad.toml

# The container's own addresses and state: every interface, the ports EXPOSEd below, the data
# volume. These override the config file's values; set them again with -e to move a port.
ENV QUOTAD_API_LISTEN=0.0.0.0:7450 \
    QUOTAD_PEER_LISTEN=0.0.0.0:7451 \
    QUOTAD_DATA_DIR=/var/lib/quotad

# 7450 the HTTP API (checks, admin, /livez, /readyz, /metrics), 7451 the peer (Raft) API of a
# multi-region cluster, 8081 Envoy's rate limit service when the config sets envoy.listen.
EXPOSE 7450 7451 8081
VOLUME ["/etc/quotad", "/var/lib/quotad"]
USER 10001:10001
WORKDIR /var/lib/quotad

# Healthy once /readyz answers 200: unhealthy while starting and while draining on SIGTERM.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 CMD ["/usr/local/bin/quotad-ready"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/quotad"]
CMD ["run", "--config", "/etc/quotad/quotad.toml"]
