"""TEST ONLY node pack: a server started with it writes the stand-ins named in ``GROUP_OFFLOAD_STAND_INS`` (see
``stand_ins``) into its folders as it starts. It registers no nodes."""
import json
import os
import sys
from pathlib import Path

_TESTS_DIR = str(Path(__file__).resolve().parent.parent)
if _TESTS_DIR not in sys.path:
    sys.path.append(_TESTS_DIR)

import stand_ins  # noqa: E402

stand_ins.write(json.loads(os.environ.get(stand_ins.ENV, "{}")))

NODE_CLASS_MAPPINGS: dict = {}
