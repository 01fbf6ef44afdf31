import pytest


@pytest.fixture(autouse=True)
def sampler_seed(monkeypatch):
    """Lightning seeds its DistributedSampler from PL_GLOBAL_SEED (0 when unset), and
    seed_everything() sets it for the whole process: pin it so that an earlier test cannot
    change which samples form a global batch in a later one."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
