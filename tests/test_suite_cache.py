"""The suite caches in a place of its own (tests/conftest.py's moemerge_cache): never the
user's $MOEMERGE_CACHE or ~/.cache/moemerge, as the README promises; $MOEMERGE_TEST_CACHE when
set (CI keeps one between its runs), else a temporary directory."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import USERS_CACHE

from moemerge.cache import cache_root, private_dir

TESTS = Path(__file__).parent


def test_moemerge_caches_in_the_suites_own_cache(moemerge_cache):
    """What moemerge makes in its cache lands in the suite's (this test makes a directory
    there, as the toy experts and the compiled kernel are made)."""
    assert cache_root() == moemerge_cache.absolute()
    assert USERS_CACHE is None or cache_root() != Path(USERS_CACHE).absolute()
    assert private_dir("suite-probe").parent == moemerge_cache.absolute()


def test_a_users_moemerge_cache_is_left_alone(tmp_path):
    """The test above, in a pytest of its own run with $MOEMERGE_CACHE set as a user's shell
    sets it: nothing is written there; with $MOEMERGE_TEST_CACHE, the suite's cache is that."""
    users, shared = tmp_path / "users-cache", tmp_path / "ci-cache"
    env = {**os.environ, "MOEMERGE_CACHE": str(users), "MOEMERGE_TEST_CACHE": str(shared),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{__file__}::test_moemerge_caches_in_the_suites_own_cache"],
                          env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert not users.exists()
    assert (shared / "suite-probe").is_dir()
