"""Where the native libraries are built and found (wna16ctl.native.build)."""

from __future__ import annotations

import tempfile

import pytest

from wna16ctl.native import build


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    if not build.find_cxx():
        pytest.skip("no C++ compiler on PATH")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "wna16ctl"


def test_a_library_is_built_beside_its_cache_entry_then_found_without_writing(empty_cache, monkeypatch):
    made_in = []
    real = tempfile.TemporaryDirectory

    def recording(*args, **kwargs):
        made_in.append(kwargs.get("dir"))
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryDirectory", recording)
    lib = build.build_header_scan()
    assert lib.parent == empty_cache and lib.is_file()
    # the objects are made in the cache directory itself, so the final rename never crosses a filesystem
    assert made_in == [empty_cache]
    assert not list(empty_cache.glob(".build-*"))

    def no_write_probe():  # a second process finds the library: nothing is written or compiled
        raise AssertionError("the cache directory was probed for writing although the library is built")

    monkeypatch.setattr(build, "_build_dir", no_write_probe)
    monkeypatch.setattr(build, "_run", lambda *a, **k: pytest.fail("compiled again"))
    assert build.build_header_scan() == lib


def test_a_library_built_in_the_fallback_directory_is_found_there(empty_cache, tmp_path, monkeypatch):
    fallback = tmp_path / "fallback"
    fallback.mkdir()
    monkeypatch.setattr(build, "_fallback_dir", lambda: fallback)
    lib = build.build_header_scan(out_dir=fallback)  # as a run whose cache directory was not writable
    monkeypatch.setattr(build, "_build_dir", lambda: pytest.fail("probed the cache directory"))
    assert build.build_header_scan() == lib
    assert not empty_cache.exists() or not list(empty_cache.iterdir())
