#!/bin/bash
# The one install recipe of the pffs CSI image (pffs/csi), run by deploy/Dockerfile and by
# scripts/build_image.sh (inside an mmdebstrap root), as root in a Debian bookworm root filesystem:
#   install.sh RECIPE_DIR
# RECIPE_DIR holds this folder's files and the repository's constraints.txt. It installs packages.txt, makes
# the virtualenv /opt/pffs with requirements.txt at the versions of constraints.txt (with the compilers of
# build-packages.txt, removed again at the end), and strips what nothing in the image runs. pffs itself is
# not installed here: it is a layer of its own over this one (see deploy/Dockerfile).
# PIP_CERT may name a CA bundle for pip (where egress passes a proxy with a CA of its own).
set -euo pipefail
recipe=$1
venv=/opt/pffs
export DEBIAN_FRONTEND=noninteractive

read_list() { sed -e 's/#.*//' -e 's/[[:space:]]*$//' -e '/^$/d' "$1"; }
mapfile -t runtime < <(read_list "$recipe/packages.txt")
mapfile -t build < <(read_list "$recipe/build-packages.txt")

apt-get update -qq
apt-get install -y -qq --no-install-recommends "${runtime[@]}" "${build[@]}" >/dev/null

# --no-compile: no __pycache__ (88 MB of it for these packages; the image sets PYTHONDONTWRITEBYTECODE, and a
# start compiles what it imports in about 1.5 s more).
python3 -m venv "$venv"
"$venv/bin/pip" install -q --no-cache-dir --no-compile \
    -c "$recipe/constraints.txt" -r "$recipe/requirements.txt"

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
# Nothing installs packages into the image once it is built.
"$venv/bin/python" -m pip uninstall -q -y pip setuptools
rm -rf "$venv"/bin/pip* "$site"/_distutils_hack "$site"/distutils-precedence.pth
# kubernetes: its asyncio client (kubernetes.aio, 40 MB) and its own tests; pffs uses kubernetes.client.
rm -rf "$site/kubernetes/aio"
find "$site/kubernetes" -name '*_test.py' -delete
# botocore: the API models of the S3 client and the credential providers' (STS, SSO, sign-in) only; the
# other 400 services' models are 22 MB that s3fs never loads.
find "$site/botocore/data" -mindepth 1 -maxdepth 1 -type d \
    ! -name s3 ! -name sts ! -name sso ! -name sso-oidc ! -name signin -exec rm -rf {} +
# Test suites of packages (numpy's), C and Cython sources next to the built pyfuse3, and its debug symbols
# (built here, so stripping it is safe; wheels' libraries are left as their authors made them).
find "$site" -depth -type d \( -name tests -o -name __pycache__ \) -exec rm -rf {} +
rm -f "$site"/pyfuse3/*.{c,h,pyx,pxi,pxd}
strip --strip-unneeded "$site"/pyfuse3/*.so

# Without the two options, apt keeps what a runtime package merely suggests (binutils, 30 MB).
apt-get purge -y -qq --autoremove -o APT::AutoRemove::SuggestsImportant=false \
    -o APT::AutoRemove::RecommendsImportant=false "${build[@]}" >/dev/null
apt-get clean
rm -rf /var/lib/apt/lists/* /var/log/apt/* /var/log/dpkg.log /var/cache/debconf/*-old /root/.cache
