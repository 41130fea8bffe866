"""The TCG translation buffer's resident size, read from a QEMU's smaps (podbay.vmmem)."""

from __future__ import annotations

from podbay.vmmem import parse_tcg_buffer_mib

_SMAPS = """\
55d0c2a00000-55d0c2e00000 r-xp 00000000 08:01 1234 /usr/bin/qemu-system-x86_64
Size:               4096 kB
Rss:                3000 kB
7f1c00000000-7f1c40000000 rwxp 00000000 00:00 0
Size:            1048572 kB
KernelPageSize:        4 kB
Rss:              524288 kB
Pss:              524288 kB
7f1c50000000-7f1c50100000 rw-p 00000000 00:00 0
Size:               1024 kB
Rss:                1024 kB
7f1c60000000-7f1c60001000 rwxp 00000000 00:00 0
Size:                  4 kB
Rss:                   4 kB
7f1c70000000-7f1c70400000 rwxp 00000000 08:01 99 /memfd:jit (deleted)
Size:               4096 kB
Rss:                4096 kB
"""


def test_the_largest_anonymous_rwx_mapping_is_the_buffer() -> None:
    # Named or file-backed rwx mappings and rw- anonymous memory are not the translation buffer.
    assert parse_tcg_buffer_mib(_SMAPS) == 512.0
    # The kernel ends an unnamed mapping's line with a space.
    assert parse_tcg_buffer_mib(_SMAPS.replace(" 00:00 0\n", " 00:00 0 \n")) == 512.0


def test_no_buffer_reads_zero() -> None:
    assert parse_tcg_buffer_mib(_SMAPS.replace("rwxp", "rw-p")) == 0.0
    assert parse_tcg_buffer_mib("") == 0.0
