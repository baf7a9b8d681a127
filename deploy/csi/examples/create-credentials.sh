#!/usr/bin/env bash
# The Secrets the examples name, from your S3 keys (nothing in this folder holds a key, so applying it never
# resets real ones): pffs-s3-credentials in pffs-system (the StorageClass pffs-s3 and the static PV: the
# CSI driver's own namespace) and in default (the inline volume: an inline volume's nodePublishSecretRef
# names a Secret of the pod's own namespace). By hand, each is
#   kubectl -n pffs-system create secret generic pffs-s3-credentials \
#     --from-literal=accessKeyId=... --from-literal=secretAccessKey=...
# Here the keys come from the environment:
#   AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... bash deploy/csi/examples/create-credentials.sh
# Run again to change the keys (create | apply replaces them).
set -euo pipefail
: "${AWS_ACCESS_KEY_ID:?set AWS_ACCESS_KEY_ID (and AWS_SECRET_ACCESS_KEY)}"
: "${AWS_SECRET_ACCESS_KEY:?set AWS_SECRET_ACCESS_KEY}"
for namespace in pffs-system default; do
    kubectl -n "$namespace" create secret generic pffs-s3-credentials \
        --from-literal=accessKeyId="$AWS_ACCESS_KEY_ID" --from-literal=secretAccessKey="$AWS_SECRET_ACCESS_KEY" \
        --dry-run=client -o yaml | kubectl apply -f -
done
