import pytest


@pytest.fixture
def torch_code(monkeypatch):
    """The torch merges themselves, the compiled kernel (merge/native) set aside: the tests of
    the torch code's row blocks; test_native.py checks the kernel's bytes against them."""
    from moemerge.merge import native

    monkeypatch.setattr(native, "library", lambda: None)
