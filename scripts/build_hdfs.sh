#!/usr/bin/env bash
# A real HDFS for tests and benchmarks: Hadoop's MiniDFSCluster from Maven Central (hadoop-minicluster and its
# runtime dependencies, ~180 jars, ~100 MB) and our small Java main over it (scripts/hdfs/PffsMiniDfs.java),
# fetched and compiled once into a cache folder that CI's clean clones reuse (Maven's ~/.m2 too).
#   scripts/build_hdfs.sh [DIR]     (default: ~/.cache/pffs-tools/hadoop-$HADOOP_VERSION)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
version="${HADOOP_VERSION:-3.4.2}"
dir="${1:-${PFFS_HADOOP_DIR:-$HOME/.cache/pffs-tools/hadoop-$version}}"
source_sum="$(cat "$here/hdfs/pom.xml" "$here/hdfs/PffsMiniDfs.java" | sha256sum | cut -d' ' -f1)"
stamp="$dir/.built"
if [ -f "$dir/classes/PffsMiniDfs.class" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$version $source_sum" ]; then
    exit 0
fi
for tool in mvn javac; do
    command -v "$tool" >/dev/null || { echo "build_hdfs.sh: $tool is needed (Maven and a JDK 17)" >&2; exit 1; }
done
echo "build_hdfs.sh: fetching hadoop-minicluster $version and compiling PffsMiniDfs into $dir (once)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp "$here/hdfs/pom.xml" "$work/pom.xml"
rm -rf "$dir/lib" "$dir/classes"
mkdir -p "$dir/lib" "$dir/classes"
(cd "$work" && mvn -q -B -Dhadoop.version="$version" dependency:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$dir/lib")
javac -d "$dir/classes" -cp "$dir/lib/*" "$here/hdfs/PffsMiniDfs.java"
echo "$version $source_sum" >"$stamp"
