#!/usr/bin/env bash
# A stand-in for the CPU image's base (python:3.11.11-slim-bookworm) where its registry cannot be
# reached, as in this project's sandbox: Debian bookworm (minbase, from Debian's own packages)
# with its Python 3.11, pip and useradd, committed to buildah's vfs storage as
# localhost/crescent-base:bookworm. tests/helm/test_image_build.py builds deploy/Dockerfile on
# it when the real base cannot be pulled. Needs root, debootstrap and buildah.
#   scripts/image_standin_base.sh [existing-rootfs-dir]
set -euo pipefail
export STORAGE_DRIVER=vfs
rootfs=${1:-}
if [ -z "$rootfs" ]; then
  rootfs=$(mktemp -d)
  debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates,passwd bookworm "$rootfs"
fi
# Behave like the python image: `python` and `pip` on PATH, pip may install into the system.
rm -f "$rootfs"/usr/lib/python3.*/EXTERNALLY-MANAGED
ln -sf python3 "$rootfs/usr/bin/python"
ln -sf pip3 "$rootfs/usr/bin/pip"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
ctr=$(buildah from scratch)
mnt=$(buildah mount "$ctr")
cp -a "$rootfs"/. "$mnt"/
buildah umount "$ctr"
buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
buildah commit --rm "$ctr" localhost/crescent-base:bookworm
