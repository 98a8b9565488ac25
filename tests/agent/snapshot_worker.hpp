// The worker of the snapshot replication tests (tls_test.cpp,
// snapshot_port_hostile_test.cpp): a shell that commits a snapshot into
// its agent's area as a zero3 save does (its rank's shard of 300,000
// random bytes, a manifest naming its node, the manifest's SHA-256
// sidecar, then `latest`, each renamed into place) with replicas = 1,
// waits until it holds the other node's replica and its own is
// acknowledged, copies both to $OUT/<node>/own.bin and $OUT/<node>/replica,
// and waits for $OUT/release.
#pragma once

#include <string>

namespace ductile::test {

// `first`: shell run before the snapshot is written (empty: none);
// `replica_seconds`: the longest wait for the replica (then exit 3).
inline std::string replicating_worker(const std::string& first, int replica_seconds) {
  return R"sh(set -e
own="$DUCTILE_SNAPSHOT_DIR"; root="${own%/own}"; mine="$OUT/$DUCTILE_AGENT_NODE_ID"
mkdir -p "$mine"
)sh" + first +
         R"sh(
printf '1\n' > "$own/replicas"
mkdir "$own/step1.tmp"
head -c 300000 /dev/urandom > "$own/step1.tmp/rank$RANK-of-2.bin"
printf '{"node":"%s","shards":[{"file":"rank0-of-2.bin","bytes":300000},{"file":"rank1-of-2.bin","bytes":300000}]}' \
  "$DUCTILE_AGENT_NODE_ID" > "$own/step1.tmp/manifest.json"
(cd "$own/step1.tmp" && sha256sum manifest.json > manifest.json.sha256)
mv "$own/step1.tmp" "$own/step1"
printf 'step1\nsha256 %s\n' "$(cut -c1-64 "$own/step1/manifest.json.sha256")" > "$own/latest.tmp"
mv "$own/latest.tmp" "$own/latest"
cp "$own/step1/rank$RANK-of-2.bin" "$mine/own.bin"
i=0
until [ "$(cat "$own/replicated" 2>/dev/null)" = 1 ] && \
      [ -n "$(ls "$root/replicas" 2>/dev/null)" ] && \
      [ -f "$root/replicas/$(ls "$root/replicas")/step1/manifest.json" ]; do
  i=$((i+1)); [ $i -lt )sh" +
         std::to_string(replica_seconds * 10) + R"sh( ] || { echo "no replica after )sh" +
         std::to_string(replica_seconds) + R"sh( s"; exit 3; }; sleep 0.1
done
cp -r "$root/replicas/$(ls "$root/replicas")/step1" "$mine/replica.tmp"
mv "$mine/replica.tmp" "$mine/replica"
echo "worker $DUCTILE_AGENT_NODE_ID holds the replica of node $(ls "$root/replicas")"
i=0
until [ -f "$OUT/release" ]; do
  i=$((i+1)); [ $i -lt 1800 ] || { echo "not released after 180 s"; exit 4; }; sleep 0.1
done
)sh";
}

}  // namespace ductile::test
