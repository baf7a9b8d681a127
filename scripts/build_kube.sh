#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager, kube-scheduler and kubelet of one Kubernetes version from
# the Go module proxy, for the tests that run a real control plane and node (tests/test_kube_real.py).
# `go install k8s.io/kubernetes/cmd/...` refuses the module's replace directives, so a throwaway module
# requires k8s.io/kubernetes at that version and replaces each of its staging modules (listed as
# `=> ./staging/...` in its own go.mod) with the matching v0.x release; one `go build` makes all four.
# The binaries go to a cache folder outside the repository and are rebuilt only for another version.
#   scripts/build_kube.sh [BIN_DIR]     (KUBE_VERSION overrides the version)
set -euo pipefail
version="${KUBE_VERSION:-v1.37.2}"
bin="${1:-${PFFS_TOOLS_BIN:-$HOME/.cache/pffs-tools/bin}/kubernetes-$version}"
components=(kube-apiserver kube-controller-manager kube-scheduler kubelet)

if [ -f "$bin/.built" ] && [ "$(cat "$bin/.built")" = "$version" ]; then
    exit 0
fi
command -v go >/dev/null || { echo "build_kube.sh: Go is needed (1.26 or later for $version)" >&2; exit 1; }

staging_version="v0.${version#v1.}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
go mod init pffs.local/kubebuild >/dev/null 2>&1
gomod="$(go mod download -json "k8s.io/kubernetes@$version" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
{
    echo "require k8s.io/kubernetes $version"
    grep -E '=> \./staging/' "$gomod" | awk -v v="$staging_version" '{print "replace " $1 " => " $1 " " v}'
} >>go.mod
go_version="$(sed -n 's/^go //p' "$gomod")"
go mod edit -go="$go_version"
echo "package main" >tools.go
printf 'import (\n' >>tools.go
for c in "${components[@]}"; do printf '\t_ "k8s.io/kubernetes/cmd/%s"\n' "$c" >>tools.go; done
printf ')\n\nfunc main() {}\n' >>tools.go
GOFLAGS=-mod=mod go mod tidy >/dev/null 2>&1 || true

ldflags="-X k8s.io/component-base/version.gitVersion=$version -X k8s.io/component-base/version.gitMajor=1"
minor="${version#v1.}"
ldflags+=" -X k8s.io/component-base/version.gitMinor=${minor%%.*}"
ldflags+=" -X k8s.io/component-base/version.gitTreeState=clean"
ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=$version"
mkdir -p "$bin"
echo "build_kube.sh: building ${components[*]} $version into $bin (the first time: ~15 minutes on 2 cores)"
pkgs=()
for c in "${components[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$c"); done
GOFLAGS=-mod=mod go build -trimpath -ldflags "$ldflags" -o "$bin/" "${pkgs[@]}"
echo "$version" >"$bin/.built"
