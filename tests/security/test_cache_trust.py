"""Nothing is loaded from a cache that others could write (docs/security.md, "The cache").

The compiled merge kernel is the one thing in $MOEMERGE_CACHE that runs: a payload library whose
constructor writes a marker stands in for an attacker's, planted where moemerge would load its
kernel (the key is computable by anyone) before the first run, swapped in after one, in a cache
directory others can write, one owned by another user, and behind a `native/` symlink to a
sticky /tmp-like directory; with a digest beside it that matches the payload. The marker never
appears: moemerge compiles its own again, or merges with the torch code and says so. Made
entries (toy sets, converted bases, real expert sets) that others could have written are refused
by name, before anything is made or read."""

import ast
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

import moemerge
from moemerge.cache import check_entry, private_dir
from moemerge.cli import app
from moemerge.errors import CacheError, Note
from moemerge.external import resolve_program
from moemerge.merge import native
from moemerge.toy.cache import cached_entry

COMPILER = shutil.which("cc")
needs_cc = pytest.mark.skipif(COMPILER is None, reason="no C compiler")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
OTHER_UID = 65534  # nobody
PAYLOAD = """#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) fclose(f);
}
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh $MOEMERGE_CACHE, and the kernel compiled without optimisation (seconds, not ten):
    its own key, so the session's compiled kernel is untouched."""
    root = tmp_path / "cache"
    monkeypatch.setenv("MOEMERGE_CACHE", str(root))
    monkeypatch.setattr(native, "FLAGS", ("-O0", "-fPIC", "-shared", "-std=c11"))
    native.library.cache_clear()
    yield root
    native.library.cache_clear()


@pytest.fixture
def payload(tmp_path):
    """(the payload library's bytes, the marker its constructor writes)."""
    marker = tmp_path / "payload-ran"
    source = tmp_path / "payload.c"
    source.write_text(PAYLOAD % marker)
    subprocess.run([COMPILER, "-shared", "-fPIC", "-o", tmp_path / "payload.so", source],
                   check=True, timeout=60)
    return (tmp_path / "payload.so").read_bytes(), marker


def plant(directory: Path, payload: bytes, *, with_digest: bool) -> Path:
    """The payload where moemerge looks for its kernel in `directory`; with a digest that
    matches it beside it (what an attacker who can write there would add)."""
    import hashlib

    key = native._key(resolve_program(COMPILER, "cc"))
    target = directory / f"merge-{key}.so"
    target.write_bytes(payload)
    if with_digest:
        (directory / f"merge-{key}.sha256").write_text(hashlib.sha256(payload).hexdigest())
    return target


def loaded() -> object:
    native.library.cache_clear()
    return native.library()


@needs_cc
def test_the_kernel_is_compiled_privately_and_loaded_from_the_checked_file(cache):
    with pytest.warns(Note, match=r"compiling moemerge's merge kernel with /\S+"):
        lib = loaded()
    assert lib is not None and lib._name.startswith("/proc/self/fd/")  # the bytes hashed
    directory = cache / "native"
    assert (directory.stat().st_mode & 0o777) == 0o700
    assert (cache.stat().st_mode & 0o777) == 0o700
    (so,) = directory.glob("merge-*.so")
    assert (directory / so.name.replace(".so", ".sha256")).is_file()
    assert not so.stat().st_mode & 0o077


@needs_cc
def test_a_library_planted_before_the_first_run_never_runs(cache, payload):
    data, marker = payload
    directory = private_dir("native")
    plant(directory, data, with_digest=False)
    with pytest.warns(Note, match="is not the library moemerge compiled"):
        assert loaded() is not None
    assert not marker.exists()


@needs_cc
def test_a_library_swapped_in_after_a_run_never_runs(cache, payload):
    data, marker = payload
    with pytest.warns(Note):
        assert loaded() is not None
    (target,) = (cache / "native").glob("merge-*.so")
    target.write_bytes(data)  # same owner, same mode: only the digest tells
    with pytest.warns(Note, match="compiling it again"):
        assert loaded() is not None
    assert not marker.exists()
    assert target.read_bytes() != data


@needs_cc
@pytest.mark.parametrize("setting", ["world-writable", "other owner", "symlink to sticky",
                                     "root world-writable"])
def test_a_kernel_cache_others_can_write_is_not_used(cache, payload, tmp_path, setting):
    data, marker = payload
    if setting == "other owner" and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    cache.mkdir(mode=0o700)
    directory = cache / "native"
    if setting == "symlink to sticky":
        shared = tmp_path / "shared-tmp"
        shared.mkdir()
        shared.chmod(0o1777)
        directory.symlink_to(shared)
    else:
        directory.mkdir(mode=0o700)
    plant(directory, data, with_digest=True)
    if setting == "world-writable":
        directory.chmod(0o777)
    elif setting == "other owner":
        for path in (directory, *directory.iterdir()):
            os.chown(path, OTHER_UID, OTHER_UID)
    elif setting == "root world-writable":
        cache.chmod(0o777)
    with pytest.warns(Note, match="the cache entry .* is not used: .*(writable by others|owned "
                                  "by uid).* torch code instead of the compiled kernel"):
        assert loaded() is None  # the torch code merges instead
    assert not marker.exists()


def test_native_off_compiles_nothing(cache, monkeypatch):
    monkeypatch.setenv("MOEMERGE_NATIVE", "0")
    assert loaded() is None
    assert not cache.exists()


def made(done: str = "done"):
    def make(out: Path) -> None:
        out.mkdir()
        (out / "weights.safetensors").write_bytes(b"x")
        (out / done).write_text("{}")
    return make


def never(out: Path) -> None:
    raise AssertionError("nothing is made in an untrusted cache")


@pytest.mark.parametrize("tamper, reason", [
    (lambda e: (e / "weights.safetensors").chmod(0o666), "owned by uid .* mode 666"),
    (lambda e: (e / "tokenizer.json").symlink_to("/etc/passwd"), "is a symlink"),
    (lambda e: e.chmod(0o777), "is writable by others"),
    (lambda e: e.parent.chmod(0o777), "toy is writable by others"),
    (lambda e: e.parent.parent.chmod(0o777), "above it, is writable by others and not sticky"),
])
def test_an_entry_others_could_have_written_is_refused(tmp_path, tamper, reason):
    final = tmp_path / "cache" / "toy" / "set"
    cached_entry(final, "done", made())
    tamper(final)
    with pytest.raises(CacheError, match=f"the cache entry .* is not used: .*{reason}.*"
                                         "MOEMERGE_CACHE"):
        cached_entry(final, "done", never)


@needs_root
def test_an_entry_holding_another_users_file_is_refused(tmp_path):
    final = tmp_path / "cache" / "toy" / "set"
    cached_entry(final, "done", made())
    os.chown(final / "weights.safetensors", OTHER_UID, OTHER_UID)
    with pytest.raises(CacheError, match=f"owned by uid {OTHER_UID}"):
        check_entry(final)


def test_an_entry_made_under_a_group_writable_umask_is_still_the_users(tmp_path):
    old = os.umask(0o002)
    try:
        final = cached_entry(tmp_path / "cache" / "toy" / "set", "done", made())
    finally:
        os.umask(old)
    assert check_entry(final) == final
    assert (tmp_path / "cache" / "toy").stat().st_mode & 0o777 == 0o700


def test_the_toy_command_refuses_a_shared_cache_before_any_work(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("MOEMERGE_CACHE", str(shared))
    result = CliRunner().invoke(app, ["toy", str(tmp_path / "out"), "--preset", "tiny"])
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert f"{shared}" in text and "writable by others" in text
    assert not (tmp_path / "out").exists() and list(shared.iterdir()) == []


def test_every_path_into_the_cache_is_made_where_reads_are_checked():
    """cache_root is named only where entries are read through check_entry / private_dir
    (toy/cache.py's cached_entry, merge/native through private_dir) and by demo's output
    placement check (which reads nothing)."""
    package = Path(moemerge.__file__).parent
    users = {path.relative_to(package).as_posix() for path in package.rglob("*.py")
             if any(isinstance(node, ast.Name | ast.alias) and
                    getattr(node, "id", getattr(node, "name", None)) == "cache_root"
                    for node in ast.walk(ast.parse(path.read_text())))}
    assert users == {"cache.py", "toy/cache.py", "demo.py"}
