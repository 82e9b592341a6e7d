#!/bin/bash
# Build a minimal rootfs (python3 + sh + coreutils basics) from the host and docker-import it.
set -euo pipefail
R=$(mktemp -d /tmp/rlsys-rootfs.XXXX); chmod 755 $R
mkdir -p $R/usr/bin $R/usr/lib $R/usr/lib64 $R/tmp $R/workspace $R/etc $R/proc $R/dev $R/sys; chmod 1777 $R/tmp
ln -s usr/bin $R/bin; ln -s usr/lib $R/lib; ln -s usr/lib64 $R/lib64; ln -s usr/bin $R/sbin
BINS="python3 python3.11 sh dash bash cat ls echo head tail sleep true false env id mkdir rm cp mv wc yes ln chmod touch grep sed prlimit"
for b in $BINS; do p=$(readlink -f /usr/bin/$b); cp -a /usr/bin/$b $R/usr/bin/ 2>/dev/null || true; cp -n $p $R/usr/bin/ 2>/dev/null || true
  for lib in $(ldd $p 2>/dev/null | grep -o '/[^ ]*'); do mkdir -p $R$(dirname $lib); cp -Ln $lib $R$lib; done; done
cp -a /usr/lib/python3.11 $R/usr/lib/
rm -rf $R/usr/lib/python3.11/test $R/usr/lib/python3.11/idlelib $R/usr/lib/python3.11/tkinter
mkdir -p $R/usr/lib/python3/dist-packages
echo "root:x:0:0:root:/root:/bin/sh" > $R/etc/passwd; echo "nobody:x:65534:65534:nobody:/nonexistent:/bin/sh" >> $R/etc/passwd
echo "root:x:0:" > $R/etc/group; echo "nogroup:x:65534:" >> $R/etc/group
tar -C $R -c . | docker import - rlsys-sandbox:latest
rm -rf $R
docker run --rm --network none rlsys-sandbox:latest python3 -c "import sys, json; print(sys.version)"
