#!/usr/bin/env bash
# Builds csi-provisioner (kubernetes-csi/external-provisioner) from the Go module proxy, for the end-to-end
# test that provisions a PVC through pffs's CSI controller. Its go.mod has replace directives, which
# `go install` refuses: a throwaway module requires it and copies them, then `go build` makes the binary.
#   scripts/build_csi_provisioner.sh [BIN_DIR]
set -euo pipefail
module="github.com/kubernetes-csi/external-provisioner/v6"
version="${PROVISIONER_VERSION:-v6.3.0}"
bin="${1:-${PFFS_TOOLS_BIN:-$HOME/.cache/pffs-tools/bin}}"
stamp="$bin/.csi-provisioner.version"
if [ -x "$bin/csi-provisioner" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$version" ]; then
    exit 0
fi
command -v go >/dev/null || { echo "build_csi_provisioner.sh: Go is needed" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
go mod init pffs.local/provisioner >/dev/null 2>&1
gomod="$(go mod download -json "$module@$version" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
{ echo "require $module $version"; grep -E '^replace ' "$gomod"; } >>go.mod
go mod edit -go="$(sed -n 's/^go //p' "$gomod")"
printf 'package main\n\nimport _ "%s/cmd/csi-provisioner"\n\nfunc main() {}\n' "$module" >tools.go
GOFLAGS=-mod=mod go mod tidy >/dev/null 2>&1 || true
echo "build_csi_provisioner.sh: building csi-provisioner $version into $bin (once)"
mkdir -p "$bin"
GOFLAGS=-mod=mod go build -trimpath -o "$bin/csi-provisioner" "$module/cmd/csi-provisioner"
echo "$version" >"$stamp"
