#!/bin/sh
# Build the volunteer image (default tag ravnest-peer:latest) from the repository root, with the base
# image made first by docker/base-image.sh when it is missing.
#   docker/build.sh [TAG]
# Local inputs it stages into the build context (both directories are git-ignored):
#   docker/wheels/  a torch==$TORCH_VERSION CPU wheel found in pip's find-links directories
#                   (PIP_FIND_LINKS, pip.conf's find-links); then the rest comes from PyPI
#   docker/ca/      the host's locally added CA certificates (/usr/local/share/ca-certificates/*.crt), or
#                   RAVNEST_EXTRA_CA (a PEM file), for a TLS-intercepting proxy; used by the build stage only
set -eu
cd "$(dirname "$0")/.."
TAG="${1:-ravnest-peer:latest}"
BASE="${RAVNEST_BASE_IMAGE:-ravnest-base:bookworm}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

docker/base-image.sh "$BASE"

rm -f docker/wheels/*.whl docker/ca/*.crt
dirs="${PIP_FIND_LINKS:-} $(pip3 config get global.find-links 2>/dev/null || true)"
for dir in $dirs; do
    dir="${dir#file://}"
    for wheel in "$dir"/torch-"$TORCH_VERSION"+cpu-cp311-*.whl "$dir"/torch-"$TORCH_VERSION"-cp311-*.whl; do
        if [ -f "$wheel" ] && [ -z "$(ls docker/wheels/*.whl 2>/dev/null)" ]; then
            ln "$wheel" docker/wheels/ 2>/dev/null || cp "$wheel" docker/wheels/
        fi
    done
done
for cert in ${RAVNEST_EXTRA_CA:-} /usr/local/share/ca-certificates/*.crt; do
    if [ -f "$cert" ]; then cp "$cert" "docker/ca/$(basename "$cert" .crt).crt"; fi
done

set -- --build-arg "BASE=$BASE" --build-arg "TORCH_VERSION=$TORCH_VERSION"
if [ -n "$(ls docker/wheels/*.whl 2>/dev/null)" ]; then
    echo "torch: local wheel $(ls docker/wheels/*.whl)"
    set -- "$@" --build-arg TORCH_INDEX="${TORCH_INDEX:-https://pypi.org/simple}"
elif [ -n "${TORCH_INDEX:-}" ]; then
    set -- "$@" --build-arg "TORCH_INDEX=$TORCH_INDEX"
fi
# --network host: build steps never use the daemon's default bridge (whatever its --bip)
DOCKER_BUILDKIT=0 docker build --network host -f docker/Dockerfile -t "$TAG" "$@" .
