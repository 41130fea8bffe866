#!/bin/busybox sh
# podbay initramfs: load the virtio and ext4 modules, mount the root disk, hand over to /sbin/podbay-init.
# The module list (/etc/modules) is written by the image build in dependency order.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

fail() {
    echo "podbay-initramfs: $*" >/dev/console
    # panic=-1 on the command line turns this into an immediate reset, which the host sees as an exit.
    echo c >/proc/sysrq-trigger 2>/dev/null
    exec sh
}

while read -r m; do
    [ -n "$m" ] || continue
    insmod "/lib/modules/$m" || fail "insmod $m failed"
done </etc/modules

# The accel probe boots this initramfs alone and only needs to see that the kernel got this far.
case " $(cat /proc/cmdline) " in
    *" podbay.probe=1 "*)
        echo "PODBAY-PROBE-OK" >/dev/console
        poweroff -f
        ;;
esac

# virtio-mmio devices are probed asynchronously: wait for the disk briefly.
i=0
while [ ! -b /dev/vda ]; do
    i=$((i + 1))
    [ "$i" -le 500 ] || fail "no /dev/vda"
    sleep 0.01
done
mount -t ext4 -o rw /dev/vda /newroot || fail "cannot mount /dev/vda"
[ -x /newroot/sbin/podbay-init ] || fail "/sbin/podbay-init missing on the root disk"
mount --move /dev /newroot/dev
umount /sys /proc
exec switch_root /newroot /sbin/podbay-init
