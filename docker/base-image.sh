#!/bin/sh
# Build the base image ravnest-base:bookworm from Debian's own packages: debootstrap of Debian bookworm
# (minbase variant) into a temporary directory, then `docker import`. No image registry is needed.
#   docker/base-image.sh [TAG]          # default tag: ravnest-base:bookworm; skipped if the tag exists
#   RAVNEST_BASE_FORCE=1 docker/base-image.sh   # rebuild even if it exists
# Needs root (debootstrap), debootstrap and a reachable Debian mirror (RAVNEST_DEBIAN_MIRROR).
set -eu
TAG="${1:-ravnest-base:bookworm}"
MIRROR="${RAVNEST_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm

if [ -z "${RAVNEST_BASE_FORCE:-}" ] && docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "base image $TAG exists: reusing it"
    exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }

ROOT="$(mktemp -d "${TMPDIR:-/tmp}/ravnest-base.XXXXXX")"
trap 'rm -rf "$ROOT"' EXIT INT TERM
debootstrap --variant=minbase "$SUITE" "$ROOT" "$MIRROR"
# the security and updates suites beside the main one, as Debian's own images have
cat > "$ROOT/etc/apt/sources.list" <<SOURCES
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb ${RAVNEST_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security} $SUITE-security main
SOURCES
# a smaller image: no apt lists or package cache, no docs or man pages
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin "$ROOT"/var/cache/apt/archives/*.deb \
    "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* "$ROOT"/usr/share/info/*
tar --numeric-owner -C "$ROOT" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase $SUITE $MIRROR" - "$TAG"
echo "built $TAG"
