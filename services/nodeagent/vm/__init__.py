"""The VMs: QEMU and QMP (vmm), the accelerator, confinement and cgroups, the serial console, the driver that
binds the VMM to this node's store and templates (vmdriver), the registry's interface (vmhost), pause/resume,
and live migration (migrate, vmmigrate)."""
