// Package vmtest tests nbdmapper through the real Linux kernel: run.sh boots
// Debian's kernel under QEMU (TCG) with a busybox initramfs that chroots into
// the host's root over 9p, and the scripts in guest/ attach nbdmapper exports
// as /dev/nbd0 there, next to the kernel's own dm-linear.
//
//	guest: mkfs / fio / dmsetup -> /dev/nbd0 -> nbdmapper serve -> /dev/vda
//	host:  internal/testing/vmtest/run.sh -> qemu-system-x86_64 -> OUTDIR/disk.img
//
// TestGuest runs guest/tests.sh and turns each VMTEST-RESULT line of the
// guest's console into a subtest. The package has no code of its own.
package vmtest
