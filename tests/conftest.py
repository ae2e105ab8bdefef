import pytest


@pytest.fixture(autouse=True, scope="session")
def _calibration_cache(tmp_path_factory):
    """Engines started by the tests keep their cost models in a fresh directory, never in the
    user's cache (whose measurements were made under other conditions)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_CALIBRATION_DIR", str(tmp_path_factory.mktemp("calibration")))
        yield
