#!/usr/bin/env bash
# Installs what pffs needs on a fresh Debian machine (run as root), and is safe to run again: system
# packages with apt-get (only those missing), then a project virtualenv in .venv with pffs installed
# editable, at the exact versions of constraints.txt (pip's resolver alone can backtrack for many minutes
# over aiobotocore). Re-runs skip the pip step unless either file changed.
#
#   scripts/setup.sh demo   only what `make demo` uses: FUSE's packages and pffs with the S3 server
#   scripts/setup.sh        everything `make test` uses: the dev tools (torch among them: several GB), the
#                           peers measured against, Go-built Kubernetes and CSI tools, Hadoop, the CSI image
set -euo pipefail
cd "$(dirname "$0")/.."
PART=${1:-all}
case "$PART" in demo | all) ;; *) echo "usage: scripts/setup.sh [demo]" >&2; exit 2 ;; esac
# One setup at a time per checkout: a second one waits, then finds everything in place.
exec 9>.setup.lock
flock 9

APT_PACKAGES=(fuse3 libfuse3-dev pkg-config gcc python3-dev python3-venv)
if [ "$PART" = all ]; then
    APT_PACKAGES+=(fio s3fs rsync containerd runc busybox-static openjdk-17-jdk-headless maven)
fi
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "setup: installing system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi

# The native core (native/: Rust, built into pffs._core by setuptools-rust whenever pffs is installed)
# needs rustup's cargo (Rust 1.85 or later; Debian's rustc is too old). Its build is cached in one target
# folder outside the repository, shared by every checkout and CI's clean clones: a rebuild compiles only
# pffs's two crates (setup.py says why that is safe across checkouts).
if ! command -v cargo >/dev/null && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null; then
    echo "setup: Rust's cargo is needed to build pffs's native core (native/): install rustup's toolchain" >&2
    exit 1
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/pffs-tools/cargo-target}"
# What the native module is built from: a change rebuilds it (below) without the whole pip step.
native_src() {
    { find native -path native/target -prune -o -type f -print; echo setup.py; } | LC_ALL=C sort | xargs cat | sha256sum
}

# The dev extra holds the demo's; a stamp per extra says what is installed at these files' versions.
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
installed() { [ -f ".venv/.pffs-installed-$1" ] && [ "$(cat ".venv/.pffs-installed-$1")" = "$want" ]; }
extra=$([ "$PART" = demo ] && echo demo || echo dev)
if ! installed dev && ! installed "$extra"; then
    echo "setup: installing Python packages ($extra) into .venv (pip cache is reused between runs)"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -c constraints.txt -e ".[$extra]"
    echo "$want" > ".venv/.pffs-installed-$extra"
    native_src > .venv/.pffs-native
fi
# The editable install built pffs._core into pffs/; rebuild it when native/ changed or it is missing.
if [ "$(native_src)" != "$(cat .venv/.pffs-native 2>/dev/null)" ] || ! compgen -G "pffs/_core.*so" >/dev/null; then
    echo "setup: building pffs's native core (native/) with cargo into $CARGO_TARGET_DIR"
    .venv/bin/python -m pip install -q --no-deps -e .
    native_src > .venv/.pffs-native
fi
if [ "$PART" = demo ]; then
    exit 0
fi

# Go-built tools for the CSI tests, built once into a cache folder outside the repository (CI's clean
# clones reuse it; Go's own module and build caches make a rebuild after a version change quick):
# csi-sanity (the CSI conformance suite; its module also brings the spec's csi.proto that
# tests/test_csi_proto.py compares ours with), kustomize (renders deploy/ for tests/test_deploy.py) and
# helm (renders and lints the chart deploy/helm/pffs-csi, from which deploy/csi is generated).
TOOLS_BIN="${PFFS_TOOLS_BIN:-$HOME/.cache/pffs-tools/bin}"
GO_TOOLS=(
    "csi-sanity github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity@v5.6.0"
    "kustomize sigs.k8s.io/kustomize/kustomize/v5@v5.7.1"
    "helm helm.sh/helm/v3/cmd/helm@v3.22.0"
)
for tool in "${GO_TOOLS[@]}"; do
    read -r name module <<<"$tool"
    stamp="$TOOLS_BIN/.$name.version"
    if [ -x "$TOOLS_BIN/$name" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$module" ]; then
        continue
    fi
    if ! command -v go >/dev/null; then
        echo "setup: Go is needed to build $name ($module); install Go 1.26 or later" >&2
        exit 1
    fi
    echo "setup: building $name with Go into $TOOLS_BIN (once)"
    mkdir -p "$TOOLS_BIN"
    GOBIN="$TOOLS_BIN" GOFLAGS=-mod=mod go install "$module"
    echo "$module" > "$stamp"
done

# Kubernetes v1.37.2 (kube-apiserver, controller-manager, scheduler, kubelet) for the tests against a real
# control plane: built once from the Go module proxy into the same cache folder (~10 minutes the first time).
bash scripts/build_kube.sh
bash scripts/build_csi_provisioner.sh
# Hadoop's MiniDFSCluster (a real HDFS on loopback) for the HDFS tests and bench.
bash scripts/build_hdfs.sh

# The CSI image without Docker (scripts/build_image.sh, tests/test_csi_image.py): mmdebstrap builds its
# Debian base, cached in ~/.cache/pffs-tools/images by a hash of deploy/image and constraints.txt (minutes
# the first time and after a recipe change; nothing otherwise). Tests add this checkout's pffs on top.
if ! command -v mmdebstrap >/dev/null; then
    echo "setup: installing mmdebstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
fi
bash scripts/build_image.sh base
