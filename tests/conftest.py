import pytest


@pytest.fixture(autouse=True, scope="session")
def _calibration_cache(tmp_path_factory):
    """Engines started by the tests keep their cost models in a fresh directory, never in the
    user's cache (whose measurements were made under other conditions)."""
    from dflash.engine import cost_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cost_model, "CACHE_DIR", tmp_path_factory.mktemp("calibration"))
        yield
