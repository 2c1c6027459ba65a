import logging
import os

import pytest

os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")


@pytest.fixture(autouse=True)
def _quiet_lightning():
    for name in ("pytorch_lightning", "lightning_fabric", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return
