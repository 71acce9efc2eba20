#!/usr/bin/env bash
# Builds tokentap's container image from this checkout: the binary for
# x86_64-unknown-linux-musl (static: no libc in the image), stripped, then
# deploy/container/Containerfile with buildah (no daemon, no registry: FROM scratch).
#
#   deploy/container/build.sh            # → localhost/tokentap:VERSION and :latest
#   podman run --rm --network host -v "$PWD/config/single.toml:/etc/tokentap/tokentap.toml:ro" \
#     localhost/tokentap:VERSION
#
# Needs: rustup target add x86_64-unknown-linux-musl; Debian's musl-tools (the C parts of
# the build) and buildah. IMAGE=name overrides the image name.
set -euo pipefail
cd "$(dirname "$0")/../.."
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
image=${IMAGE:-localhost/tokentap}
target=x86_64-unknown-linux-musl
for tool in musl-gcc buildah; do
  command -v "$tool" >/dev/null || { echo "$tool is missing (apt-get install musl-tools buildah)" >&2; exit 1; }
done
rustup target list --installed | grep -qx "$target" || rustup target add "$target"
# A target dir of its own: the glibc build's stays as it is.
CARGO_TARGET_DIR=target/container \
CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=symbols \
CC_x86_64_unknown_linux_musl=musl-gcc \
  cargo build --release --locked --target "$target" --bin tokentap
bin=target/container/$target/release/tokentap
file "$bin" | grep -q "static" || { echo "$bin is not static: $(file "$bin")" >&2; exit 1; }
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
cp "$bin" "$ctx/tokentap"
cp /etc/ssl/certs/ca-certificates.crt "$ctx/"
printf 'root:x:0:0:root:/:/sbin/nologin\ntokentap:x:65532:65532:tokentap:/:/sbin/nologin\n' > "$ctx/passwd"
printf 'root:x:0:\ntokentap:x:65532:\n' > "$ctx/group"
buildah build --quiet -f deploy/container/Containerfile -t "$image:$version" -t "$image:latest" "$ctx" >/dev/null
size=$(buildah inspect --format '{{.Docker.Size}}' "$image:$version" 2>/dev/null || true)
echo "built $image:$version ($(du -h "$bin" | cut -f1) binary)"
