"""Fixtures of the serving tests."""

from __future__ import annotations

import pytest

from server.serving.model_setup import serve_folders
from tests.server.conftest import make_settings, wait_ready


@pytest.fixture
def several(live, tmp_path, tiny_pair_dirs, tiny_spm_dir, tiny_base_model_dir):
    """start(**settings) -> a live server over tiny-big, tiny-small, tiny-spm and tiny-base."""

    def start(governor=None, keep_warm=False, **overrides):
        # the governor's moves load on demand here; stand-ins while a model loads are tested on their own
        overrides = {"model": "tiny-small", "context_length": 128, "cold_start": "wait", **overrides}
        settings = make_settings(tmp_path, **overrides)
        served = serve_folders(settings, [*tiny_pair_dirs, tiny_spm_dir, tiny_base_model_dir])
        srv = live(served=served, governor=governor, **overrides)
        # these tests follow the shedding of idle bigger models, as on a device short of memory
        if not keep_warm:
            srv.app.state.runtime.worker.placement.keep_warm = None
        wait_ready(srv)
        return srv, served

    return start
