#!/opt/podbay/bin/busybox sh
# podbay guest init for templates built FROM an OCI image (build/oci.py). The image may have no shell, no
# tini and no Python, or another libc, so this uses only what podbay put under /opt/podbay: busybox's
# applets, a static tini, and guestd's own runtime started through its own dynamic loader. Otherwise as
# podbay-init.sh: mount the API filesystems, name the host, bring up lo, run guestd under tini.
BB=/opt/podbay/bin/busybox
RT=/opt/podbay/rt

# Debian's static busybox has no mountpoint applet: /proc/mounts says what is mounted.
[ -e /proc/mounts ] || $BB mount -t proc -o nosuid,nodev,noexec proc /proc
mounted() { $BB grep -qs " $1 " /proc/mounts; }
mounted /sys || $BB mount -t sysfs -o nosuid,nodev,noexec sysfs /sys
mounted /dev || $BB mount -t devtmpfs -o nosuid,mode=0755 devtmpfs /dev
$BB mkdir -p /dev/pts /dev/shm /tmp /run
$BB mount -t devpts -o nosuid,noexec,gid=5,mode=0620,ptmxmode=0666 devpts /dev/pts
$BB mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs /dev/shm
$BB mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs /tmp
$BB mount -t tmpfs -o nosuid,nodev,mode=0755 tmpfs /run
[ -e /dev/fd ] || $BB ln -s /proc/self/fd /dev/fd
[ -e /dev/ptmx ] || $BB ln -s pts/ptmx /dev/ptmx

# The same TCG idle-cost settings as podbay-init.sh.
echo 0 >/proc/sys/vm/compaction_proactiveness 2>/dev/null || true
echo 10 >/proc/sys/vm/stat_interval 2>/dev/null || true

$BB hostname "$($BB cat /etc/hostname 2>/dev/null || echo podbay)"
$BB ip link set lo up

echo "podbay-init: starting guestd (OCI image)" >/dev/console
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
exec $RT/bin/tini -s -- $BB env PYTHONPATH=/opt/podbay/lib \
    $RT/lib/ld-linux-x86-64.so.2 --library-path $RT/lib $RT/bin/python3.11 -B -m podbay_guestd
