"""Fixtures of the serving tests."""

from __future__ import annotations

import pytest

from server.serving.model_setup import serve_folders
from tests.server.conftest import make_settings, wait_ready


@pytest.fixture
def several(live, tmp_path, tiny_pair_dirs, tiny_spm_dir, tiny_base_model_dir):
    """start(**settings) -> a live server over tiny-big, tiny-small, tiny-spm and tiny-base."""

    def start(governor=None, **overrides):
        overrides = {"model": "tiny-small", "context_length": 128, **overrides}
        settings = make_settings(tmp_path, **overrides)
        served = serve_folders(settings, [*tiny_pair_dirs, tiny_spm_dir, tiny_base_model_dir])
        srv = live(served=served, governor=governor, **overrides)
        wait_ready(srv)
        return srv, served

    return start
