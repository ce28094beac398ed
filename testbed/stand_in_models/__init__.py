"""TEST ONLY node pack: a server started with it writes the stand-ins named in ``GROUP_OFFLOAD_STAND_INS`` (see
``stand_ins``) into its folders as it starts. It registers no nodes."""
import json
import os
import sys
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parents[2])  # where the testbed package is (appended: see comfy_boot)
if _REPO_ROOT not in sys.path:
    sys.path.append(_REPO_ROOT)

from testbed import stand_ins  # noqa: E402

stand_ins.write(json.loads(os.environ.get(stand_ins.ENV, "{}")))

NODE_CLASS_MAPPINGS: dict = {}
