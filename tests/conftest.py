import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the shared harness modules beside the tests

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def private_build_cache(tmp_path_factory):
    """Builds in the tests lower through a cache of their own, not the user's ~/.cache/npumoe/builds."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NPUMOE_BUILD_CACHE", str(tmp_path_factory.mktemp("build-cache")))
        yield
