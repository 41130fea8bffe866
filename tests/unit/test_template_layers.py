"""Build cache keys and the layer store (services/nodeagent/build/layers.py), and the build context checks
(libs/podbay/buildcontext.py)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from podbay.buildcontext import (
    ContextError,
    ContextTooLarge,
    DockerIgnore,
    MissingSource,
    check_context,
    pack_context,
    sources_digest,
    unpack_context,
)
from podbay.contracts.templates import ImageConfig
from podbay.dockerfile import parse_dockerfile
from podbay_nodeagent.build.layers import LayerCache, layer_bytes, layer_key, start_key, template_digest, uncached_key


def _steps(text: str) -> list:
    return list(parse_dockerfile("FROM base\n" + text).steps)


def test_layer_key_depends_on_parent_and_step_text_only() -> None:
    a, = _steps("RUN make\n")
    moved, = _steps("# comment\n\nRUN make\n")
    other, = _steps("RUN make install\n")
    assert layer_key("p", a) == layer_key("p", moved)
    assert layer_key("p", a) != layer_key("q", a)
    assert layer_key("p", a) != layer_key("p", other)


def test_a_changed_last_step_keeps_the_prefix_keys() -> None:
    one = _steps("RUN a\nCOPY x /x\nRUN b\n")
    two = _steps("RUN a\nCOPY x /x\nRUN c\n")

    def keys(steps: list) -> list[str]:
        out, prev = [], "parent"
        for s in steps:
            prev = layer_key(prev, s)
            out.append(prev)
        return out

    k1, k2 = keys(one), keys(two)
    assert k1[:2] == k2[:2] and k1[2] != k2[2]


def test_copy_digest_is_part_of_the_key() -> None:
    step, = _steps("COPY x /x\n")
    assert layer_key("p", step.model_copy(update={"digests": "a"})) != layer_key("p", step.model_copy(update={"digests": "b"}))


def test_template_digest_changes_with_config() -> None:
    assert template_digest("k", ImageConfig()) != template_digest("k", ImageConfig(user="agent"))
    assert template_digest("k", ImageConfig(env={"A": "1"})) == template_digest("k", ImageConfig(env={"A": "1"}))


def test_sources_digest_follows_content_and_mode(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    f = tmp_path / "app" / "main.py"
    f.write_text("print(1)\n")
    d1 = sources_digest(tmp_path, ["app"])
    f.write_text("print(2)\n")
    d2 = sources_digest(tmp_path, ["app"])
    os.chmod(f, 0o755)
    d3 = sources_digest(tmp_path, ["app"])
    assert len({d1, d2, d3}) == 3
    assert sources_digest(tmp_path, ["app"]) == d3


def test_layer_cache_commit_sweep_and_lru(tmp_path: Path) -> None:
    cache = LayerCache(tmp_path / "layers")
    for i, key in enumerate(("k1", "k2", "k3")):
        tmp = cache.tmp_dir(key)
        (tmp / "disk.img").write_bytes(b"x" * 65536)
        cache.commit(tmp, key, {"step": f"RUN {i}"})
        os.utime(cache.path(key) / "layer.json", (1000 + i, 1000 + i))
    assert all(cache.has(k) for k in ("k1", "k2", "k3"))
    half = cache.tmp_dir("k4")  # a build that died mid-step
    assert not cache.has("k4") and half.exists()
    assert cache.sweep() == 1 and not half.exists()
    cache.touch("k1")  # used now: the newest
    keep = layer_bytes(cache.path("k1")) + layer_bytes(cache.path("k3"))
    assert cache.gc(keep) == ["k2"]  # the bound holds the two most recently used exactly
    assert cache.has("k1") and cache.has("k3") and not cache.has("k2")


def test_layer_cache_is_bounded_by_allocated_bytes_least_recently_used_first(tmp_path: Path) -> None:
    cache = LayerCache(tmp_path / "layers")
    sizes = {"a": 64, "b": 256, "c": 64, "d": 128}  # KiB written into each layer's disk
    for i, (key, kib) in enumerate(sizes.items()):
        tmp = cache.tmp_dir(key)
        (tmp / "disk.img").write_bytes(os.urandom(kib * 1024))
        with (tmp / "ram").open("wb") as f:
            f.truncate(1 << 30)  # a sparse GiB: its holes allocate nothing and count nothing
        cache.commit(tmp, key, {"step": key})
        os.utime(cache.path(key) / "layer.json", (1000 + i, 1000 + i))
    used = {k: layer_bytes(cache.path(k)) for k in sizes}
    assert all(sizes[k] * 1024 <= used[k] < sizes[k] * 1024 + (64 << 10) for k in sizes), used
    assert cache.gc(sum(used.values())) == []  # at the bound: nothing goes
    cache.touch("a")  # order now b, c, d, a
    # Under the bound by one byte: the least recently used (b, the largest) goes, and that is enough.
    assert cache.gc(sum(used.values()) - 1) == ["b"]
    # c alone is not enough to fit a bound of a's size: c then d go, a (the newest) stays.
    assert cache.gc(used["a"]) == ["c", "d"]
    assert [k for k in sizes if cache.has(k)] == ["a"]
    assert cache.gc(0) == [] and cache.has("a")  # the most recently used stays, even over the bound alone


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_check_context_finds_sources_and_refuses_missing_or_large() -> None:
    spec = parse_dockerfile("FROM base\nCOPY app /srv/app\nCOPY conf/a.ini /etc/\n")
    data = _tar({"app/main.py": b"1", "conf/a.ini": b"2"})
    check_context(spec, data)
    with pytest.raises(MissingSource) as info:
        check_context(spec, _tar({"app/main.py": b"1"}))
    assert info.value.details == {"line": 3, "source": "conf/a.ini"} and info.value.http_status == 400
    with pytest.raises(ContextTooLarge):
        check_context(spec, data, max_bytes=10)


def test_pack_and_unpack_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "ctx"
    (src / "app").mkdir(parents=True)
    (src / "app" / "x.txt").write_text("hi")
    out = tmp_path / "out"
    unpack_context(pack_context(src), out)
    assert (out / "app" / "x.txt").read_text() == "hi"


def test_pack_leaves_out_what_dockerignore_excludes_as_docker_does(tmp_path: Path) -> None:
    src = tmp_path / "ctx"
    for rel in ("app/main.py", "app/x.pyc", "top.pyc", "app/__pycache__/m.pyc", "build/out.o", "build/keep.txt",
                "docs/a1.md", "docs/z.md"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(rel)
    (src / "venv" / "bin").mkdir(parents=True)
    (src / "venv" / "bin" / "python").symlink_to("/usr/bin/python3")  # a virtualenv's absolute link
    (src / "rel-link").symlink_to("app/main.py")
    (src / ".dockerignore").write_text("# build outputs\n*.pyc\n**/__pycache__\n/venv/\nbuild\n"
                                       "!build/keep.txt\ndocs/[a-c]*.md\n")
    out = tmp_path / "out"
    unpack_context(pack_context(src), out)
    got = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if not p.is_dir())
    # `*.pyc` is anchored at the root (Docker's rule, not git's), so app/x.pyc stays.
    assert got == [".dockerignore", "app/main.py", "app/x.pyc", "build/keep.txt", "docs/z.md", "rel-link"]
    assert (out / "rel-link").is_symlink() and os.readlink(out / "rel-link") == "app/main.py"


def test_an_absolute_link_in_the_context_is_refused_with_the_way_out(tmp_path: Path) -> None:
    src = tmp_path / "ctx"
    src.mkdir()
    (src / "link").symlink_to("/etc/hostname")
    with pytest.raises(ContextError, match="dockerignore"):
        unpack_context(pack_context(src), tmp_path / "out")
    with pytest.raises(ContextError, match="unclosed"):
        DockerIgnore("a[b\n")


def test_start_key_follows_the_command_its_context_and_readiness() -> None:
    cfg = ImageConfig(start_cmd=["python3", "-m", "http.server"], ready_port=8000)
    assert start_key("k", cfg) == start_key("k", cfg.model_copy())
    others = [cfg.model_copy(update=u) for u in ({"ready_port": 8001}, {"user": "agent"}, {"env": {"A": "1"}},
                                                 {"workdir": "/srv"}, {"start_cmd": ["true"]})]
    assert len({start_key("k", cfg), start_key("j", cfg), *(start_key("k", o) for o in others)}) == 7
    assert start_key("k", cfg.model_copy(update={"labels": {"x": "y"}})) == start_key("k", cfg)


def test_slow_layers_are_shared_across_stores_and_fetched_whole(tmp_path: Path) -> None:
    shared = tmp_path / "cache" / "layers"
    a = LayerCache(tmp_path / "a" / "layers", shared=shared, share_min_s=30.0, shared_max_bytes=1)
    for key, took in (("quick", 1.0), ("slow", 45.0)):
        tmp = a.tmp_dir(key)
        (tmp / "disk.img").write_bytes(key.encode())
        a.commit(tmp, key, {"step": key}, took)
    assert (shared / "slow" / "layer.json").exists() and not (shared / "quick").exists()
    b = LayerCache(tmp_path / "b" / "layers", shared=shared)  # another stack's store on this host
    assert b.has("slow") and not b.has("quick") and not b.path("slow").exists()
    assert (b.local("slow") / "disk.img").read_bytes() == b"slow"
    assert (b.path("slow") / "layer.json").exists()
    tmp = a.tmp_dir("slower")
    a.commit(tmp, "slower", {"step": "slower"}, 60.0)
    # shared_max_bytes=1: the older one went; the newest, over the bound alone, stays
    assert sorted(p.name for p in shared.iterdir()) == ["slower"]


def test_uncached_keys_are_the_builds_own() -> None:
    # BuildSpec.no_cache_from (E2B's skip_cache): a forced step's key is found in no cache, and differs per build
    assert uncached_key("k", "b1") != "k" and uncached_key("k", "b1") == uncached_key("k", "b1")
    assert uncached_key("k", "b1") != uncached_key("k", "b2") and uncached_key("j", "b1") != uncached_key("k", "b1")
