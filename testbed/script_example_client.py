"""ComfyUI's own API client, ``script_examples/websockets_api_example.py``, run on a prompt of ours.

The example defines its client (``queue_prompt``, ``get_history``, ``get_image``, ``get_images``) and then runs
an SD 1.5 prompt against 127.0.0.1:8188 at import. This runs the definitions unchanged, points
``server_address`` at our server and drives ``get_images`` as the example does, in an environment with
websocket-client (dev.py's user tools). Standard library only besides that.

``python script_example_client.py COMFYUI_PATH HOST:PORT < prompt.json`` prints
``{node_id: [sha256 of each image the example downloaded]}``.
"""
from __future__ import annotations

import ast
import hashlib
import json
import sys
from pathlib import Path
from types import ModuleType

EXAMPLE = Path("script_examples") / "websockets_api_example.py"
EXAMPLE_RUN_STARTS_AT = "prompt_text"  # the first name the example's own run assigns


def load_example_client(comfyui: Path) -> ModuleType:
    """The example's imports and client functions, as a module: its statements up to its own run."""
    source = (comfyui / EXAMPLE).read_text()
    tree = ast.parse(source)
    run_starts = next(i for i, node in enumerate(tree.body)
                      if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == EXAMPLE_RUN_STARTS_AT)
    client = ModuleType("websockets_api_example")
    exec(compile(ast.Module(tree.body[:run_starts], type_ignores=[]), str(comfyui / EXAMPLE), "exec"),  # noqa: S102
         client.__dict__)
    return client


def main(comfyui: str, server_address: str) -> None:
    client = load_example_client(Path(comfyui))
    client.server_address = server_address
    ws = client.websocket.WebSocket()
    ws.connect(f"ws://{server_address}/ws?clientId={client.client_id}")
    try:
        images = client.get_images(ws, json.load(sys.stdin))
    finally:
        ws.close()
    json.dump({node: [hashlib.sha256(data).hexdigest() for data in datas] for node, datas in images.items()},
              sys.stdout)


if __name__ == "__main__":
    main(*sys.argv[1:])
