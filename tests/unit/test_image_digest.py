"""What the base image's cache keys cover (image.py): a guestd change rebuilds only the final image."""

from __future__ import annotations

from pathlib import Path

import pytest

import podbay_nodeagent.build.image as image
from podbay_nodeagent.build.image import ImageSpec


@pytest.fixture
def sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    guestd = tmp_path / "guestd"
    guestd.mkdir()
    (guestd / "__main__.py").write_text("print('v1')\n")
    frames = tmp_path / "frames.py"
    frames.write_text("FRAMES = 1\n")
    monkeypatch.setattr(image, "guestd_sources", lambda: (guestd, frames))
    return guestd, frames


def test_guestd_change_changes_only_the_image_digest(sources: tuple[Path, Path]) -> None:
    guestd, frames = sources
    spec = ImageSpec()
    kdir = Path("kernels/linux-image-x_1")
    before = (image._image_digest(spec, "linux-image-x", kdir), image._debootstrap_key(spec))
    (guestd / "__main__.py").write_text("print('v2')\n")
    after = (image._image_digest(spec, "linux-image-x", kdir), image._debootstrap_key(spec))
    assert after[0] != before[0]
    assert after[1] == before[1]
    frames.write_text("FRAMES = 2\n")
    assert image._image_digest(spec, "linux-image-x", kdir) != after[0]


def test_bytecode_does_not_change_the_digest(sources: tuple[Path, Path]) -> None:
    guestd, _ = sources
    spec = ImageSpec()
    kdir = Path("k")
    before = image._image_digest(spec, "p", kdir)
    (guestd / "__pycache__").mkdir()
    (guestd / "__pycache__" / "__main__.cpython-311.pyc").write_bytes(b"\0junk")
    assert image._image_digest(spec, "p", kdir) == before


def test_package_list_and_kernel_are_in_the_keys(sources: tuple[Path, Path]) -> None:
    spec = ImageSpec()
    more = ImageSpec(packages=spec.packages + ("git",))
    assert image._debootstrap_key(spec) != image._debootstrap_key(more)
    assert image._image_digest(spec, "p", Path("k1")) != image._image_digest(spec, "p", Path("k2"))
    assert image._image_digest(spec, "p", Path("k")) != image._image_digest(more, "p", Path("k"))
