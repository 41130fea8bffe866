#!/bin/sh
# podbay guest init (PID 1 after switch_root): mount the API filesystems, name the host, bring up lo, and run
# guestd under tini, which reaps orphans and forwards signals.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
BB=/opt/podbay/bin/busybox

mountpoint -q /proc || mount -t proc -o nosuid,nodev,noexec proc /proc
mountpoint -q /sys || mount -t sysfs -o nosuid,nodev,noexec sysfs /sys
mountpoint -q /dev || mount -t devtmpfs -o nosuid,mode=0755 devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts -o nosuid,noexec,gid=5,mode=0620,ptmxmode=0666 devpts /dev/pts
mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs /dev/shm
mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs /tmp
mount -t tmpfs -o nosuid,nodev,mode=0755 tmpfs /run
[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd
[ -e /dev/ptmx ] || ln -s pts/ptmx /dev/ptmx

# Under TCG every guest wakeup is emulated, so an idle guest's timers cost host CPU, which limits how many
# run on a node: no proactive compaction (kcompactd wakes every 500 ms otherwise) and per-CPU memory
# statistics folded every 10 s, not every second. Measured on an idle guest: QEMU at 1.67% of a core, from 1.96%.
echo 0 >/proc/sys/vm/compaction_proactiveness 2>/dev/null || true
echo 10 >/proc/sys/vm/stat_interval 2>/dev/null || true

hostname "$(cat /etc/hostname 2>/dev/null || echo podbay)"
$BB ip link set lo up

echo "podbay-init: starting guestd" >/dev/console
exec tini -s -- env PYTHONPATH=/opt/podbay/lib python3 -m podbay_guestd
